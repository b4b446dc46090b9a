"""The kernel suites skip themselves where the kernels cannot load; this one makes sure that is never because the
C source stopped compiling: on a CPU and machine that can build them, every ISA level the CPU has must build and
load (a compile error would otherwise turn hundreds of kernel tests into skips)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tokenspout.kernels import cpu


@pytest.mark.skipif(not cpu.available_isas() or not (shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc"))
                    or os.environ.get("TOKENSPOUT_KERNELS") == "0",
                    reason="no AVX2 CPU, no C compiler or TOKENSPOUT_KERNELS=0: the kernels are off by design here")
@pytest.mark.parametrize("isa", cpu.available_isas())
def test_every_level_the_cpu_has_compiles(isa):
    with tempfile.TemporaryDirectory() as tmp:
        cpu._build(Path(tmp) / "decode_cpu.so", isa=isa)  # raises with the compiler's message on an error
    assert cpu.load(isa) is not None
