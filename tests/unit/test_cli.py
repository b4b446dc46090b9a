"""Command-line flags map to engine settings as documented."""

from __future__ import annotations

import argparse

import pytest

from tokenspout.entrypoints.cli import add_engine_args, engine_kwargs


def kwargs(*argv: str) -> dict:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return engine_kwargs(p.parse_args(list(argv)))


def test_quantization_auto_is_int4_for_the_default_model_only():
    assert kwargs()["quantization"] == "int4"
    assert kwargs("--model", "/some/folder")["quantization"] is None
    assert kwargs("--quantization", "none")["quantization"] is None
    assert kwargs("--model", "/m", "--quantization", "int8")["quantization"] == "int8"
    assert kwargs()["dtype"] == "auto"


def test_bad_quantization_flag_is_refused():
    with pytest.raises(SystemExit):
        kwargs("--quantization", "int3")
