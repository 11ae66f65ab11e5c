"""ServerArgs fields with a fixed set of values: an Engine keyword gets the check the CLI's argparse choices give,
so a typo is refused by name instead of falling through to a default branch."""

from __future__ import annotations

import argparse
from dataclasses import fields

import pytest

from runtime.config import ServerArgs, add_server_args
from runtime.executor.model_runner import ModelRunner

CHOICE_FIELDS = {f.name: f.metadata["choices"] for f in fields(ServerArgs) if f.metadata.get("choices")}


def test_the_fields_with_choices_include_the_formats():
    assert {"dtype", "quantization", "kv_cache_dtype", "attention_backend", "log_level"} <= set(CHOICE_FIELDS)


@pytest.mark.parametrize("name", sorted(CHOICE_FIELDS))
def test_a_keyword_outside_a_fields_choices_is_refused_by_name(name):
    with pytest.raises(ValueError, match=rf"^{name}: 'bogus' is not one of: {', '.join(CHOICE_FIELDS[name])}$"):
        ServerArgs(**{"device": "cpu", name: "bogus"}).validate()


@pytest.mark.parametrize("name", sorted(CHOICE_FIELDS))
def test_the_cli_takes_the_same_choices(name, capsys):
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    flag = "--" + name.replace("_", "-")
    for value in CHOICE_FIELDS[name]:
        assert getattr(parser.parse_args([flag, value]), name) == value
    with pytest.raises(SystemExit):
        parser.parse_args([flag, "bogus"])
    assert "invalid choice: 'bogus'" in capsys.readouterr().err


def test_every_log_level_is_accepted():
    for level in CHOICE_FIELDS["log_level"]:
        ServerArgs(device="cpu", log_level=level).validate()


def test_a_model_runner_checks_args_whose_device_and_dtype_are_already_concrete():
    """Hand-made args (an in-process runner) get resolve()'s checks and defaults too, not only "auto" ones."""
    with pytest.raises(ValueError, match=r"^kv_cache_dtype: 'fp8' is not one of"):
        ModelRunner(ServerArgs(model="random:tiny", device="cpu", dtype="float32", kv_cache_dtype="fp8"))
    runner = ModelRunner(ServerArgs(model="random:tiny", device="cpu", dtype="float32", max_total_tokens=256,
                                    log_level="warning"))
    assert runner.args.chunked_prefill_size == 1024 and runner.args.mem_fraction_static == 0.2
    assert runner.args.disable_cuda_graph
