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


_MISSING = [isa for isa in cpu.ISA_LEVELS if isa not in cpu.available_isas()]


@pytest.mark.skipif(not _MISSING or not (shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc"))
                    or os.environ.get("TOKENSPOUT_KERNELS") == "0",
                    reason="this CPU runs every ISA level (tested above), or no C compiler")
@pytest.mark.parametrize("isa", _MISSING)
def test_levels_the_cpu_lacks_still_compile(isa):
    """A level this CPU cannot run (the AVX-512 build on an AVX2 machine) is still compiled, not loaded: its code
    changes with every edit of the shared sources, and on a machine without it nothing else would notice a break."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "decode_cpu.so"
        try:
            cpu._build(out, isa=isa)
        except RuntimeError as e:
            if "unrecognized" in str(e) and "-m" in str(e):  # a compiler too old for the level's flags
                pytest.skip(f"the compiler lacks {isa}'s flags: {str(e)[-300:]}")
            raise
        assert out.stat().st_size > 0
