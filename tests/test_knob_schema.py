"""The one knob schema (core/config.py): every knob is a flag of the commands that take it,
an EngineArgs field, and (where shared) a lab option, with one default; device defaults come
from one function; a knob can be declared as accepted-without-effect or refused."""

from __future__ import annotations

import argparse
import dataclasses
import logging
from dataclasses import dataclass
from typing import ClassVar

import pytest

from iterserve.core import config
from iterserve.core.config import (ENGINE_CONFIGS, SERVER_CONFIGS, CacheConfig, GenerateConfig,
                                   SchedulerConfig, add_config_arguments, config_from, default_on,
                                   flag_of, knob, knob_fields, knob_notices, knobs_of, per_device)
from iterserve.engine.args import EngineArgs
from iterserve.errors import ConfigError


def _parser(command: str) -> argparse.ArgumentParser:
    from iterserve.cli import build_parser

    parser = build_parser(command)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in parser._actions for s in a.option_strings}


@pytest.mark.parametrize("command, classes", [
    ("serve", ENGINE_CONFIGS + SERVER_CONFIGS),
    ("generate", ENGINE_CONFIGS + (GenerateConfig,)),
])
def test_every_knob_is_a_flag_with_its_help_and_default(command, classes):
    parser = _parser(command)
    flags = _flags(parser)
    help_text = " ".join(parser.format_help().split())
    engine_defaults = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    for name, (default, k, cls) in knobs_of(*classes).items():
        action = flags[flag_of(name, k)]
        assert action.dest == name
        for alias in k.aliases:
            assert flags[alias] is action
        assert " ".join(k.help.split())[:40] in help_text, name
        want = engine_defaults[name] if cls in ENGINE_CONFIGS else default
        assert action.default == getattr(want, "value", want), name


def test_serve_help_points_at_the_environment_variables():
    from iterserve import envs

    text = " ".join(_parser("serve").format_help().split())
    assert "Environment variables" in text
    for name in envs.VARIABLES:
        assert name in text


def test_every_engine_knob_is_an_engine_arg_with_the_schema_default():
    fields = {f.name: f for f in dataclasses.fields(EngineArgs)}
    schema = knobs_of(*ENGINE_CONFIGS)
    assert set(fields) == set(schema)
    for name, (default, k, _) in schema.items():
        assert fields[name].metadata["knob"] is k
        expect = None if k.late_default else getattr(default, "value", default)
        assert fields[name].default == expect, name


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:1"])
def test_engine_args_resolve_every_knob_to_the_schema_default_for_its_device(device):
    a = EngineArgs(device=device)
    configs = {SchedulerConfig: a.create_scheduler_config(model_limit=1 << 20),
               CacheConfig: a.create_cache_config(bytes_per_block=1 << 20),
               config.ParallelConfig: a.create_parallel_config(),
               config.KernelConfig: a.create_kernel_config()}
    for cls, resolved in configs.items():
        for name, default, k in knob_fields(cls):
            if k.derived is not None and k.device_default is None:
                continue                     # derived from the model / memory: below
            assert getattr(resolved, name) == default_on(k, default, device), (device, name)
    s = configs[SchedulerConfig]
    assert s.max_model_len == 2048            # the knob's cap, below a large model limit
    assert configs[CacheConfig].num_kv_blocks == 1024      # 1 GiB at 1 MiB a block
    assert configs[CacheConfig].num_swap_blocks == 0


def test_device_defaults_are_the_cpus_unless_a_device_declares_its_own():
    seqs = knobs_of(SchedulerConfig)["max_num_seqs"][1]
    assert [default_on(seqs, 32, d) for d in ("cpu", None, "cuda:0", "mps")] == [32, 32, 256, 32]
    assert EngineArgs().create_scheduler_config(4096).max_num_batched_tokens == 256
    assert EngineArgs(device="cuda").create_scheduler_config(4096).max_num_batched_tokens == 2048
    assert SchedulerConfig().validate().max_num_batched_tokens == 256      # core: the CPU's
    # An explicit value wins on any device.
    assert EngineArgs(device="cuda", max_num_seqs=4).create_scheduler_config().max_num_seqs == 4


def test_shared_lab_options_have_the_engine_default_unless_the_lab_says_why():
    from iterserve.lab.options import LAB_DEFAULTS, OPTION_DEFAULTS, SHARED_KNOBS, lab_default

    schema = knobs_of(SchedulerConfig, CacheConfig)
    for name in SHARED_KNOBS:
        default, k, _ = schema[name]
        engine = getattr(default_on(k, default, "cpu"), "value", default_on(k, default, "cpu"))
        if name in LAB_DEFAULTS:
            value, why = LAB_DEFAULTS[name]
            assert len(why) > 40 and OPTION_DEFAULTS[name] == value == lab_default(name)
        else:
            assert OPTION_DEFAULTS[name] == engine, name
    assert set(LAB_DEFAULTS) <= set(SHARED_KNOBS)


def test_every_shared_lab_option_is_a_lab_flag():
    from iterserve.lab.options import SHARED_KNOBS

    flags = _flags(_parser("lab"))
    schema = knobs_of(SchedulerConfig, CacheConfig)
    for name in SHARED_KNOBS:
        assert flags[flag_of(name, schema[name][1])].dest == name


def test_the_tool_call_parser_choices_are_the_parsers_iterserve_has():
    from iterserve.tools import TOOL_PARSERS

    k = knobs_of(config.FrontendConfig)["tool_call_parser"][1]
    assert set(k.choices) == set(TOOL_PARSERS)


def test_the_reasoning_parser_choices_are_the_parsers_iterserve_has():
    from iterserve.reasoning import REASONING_PARSERS

    k = knobs_of(config.FrontendConfig)["reasoning_parser"][1]
    assert set(k.choices) == set(REASONING_PARSERS)


def test_server_knobs_are_checked_with_the_engines_messages():
    with pytest.raises(ConfigError, match="max_request_body_bytes must be at least 1"):
        config_from(config.ServerConfig, {"max_request_body_bytes": 0})
    with pytest.raises(ConfigError, match="--metrics-require-auth needs --api-key"):
        config_from(config.ServerConfig, {"metrics_require_auth": True})
    with pytest.raises(ConfigError, match="max_log_len must be at least 0"):
        config_from(config.FrontendConfig, {"max_log_len": -1})
    with pytest.raises(ConfigError, match="log_level must be one of"):
        config_from(config.ServerConfig, {"log_level": "loud"})


# --- a flag accepted without effect, or refused: one declaration each -------------------
@dataclass(slots=True)
class _PastedFlags:
    TITLE: ClassVar[str] = "pasted"
    trust_remote_code: bool = knob(False, "run the model repository's own code", bool,
                                   no_effect="iterserve runs its own model code")
    enable_lora: bool = knob(False, "serve LoRA adapters", bool,
                             refused="LoRA adapters are not supported yet (issue 99)")
    max_loras: int = knob(1, "adapters at once", int, minimum=1, refused="needs --enable-lora")

    def validate(self) -> "_PastedFlags":
        config._check_fields(self)
        return self


def test_a_knob_without_effect_is_accepted_with_one_notice():
    p = argparse.ArgumentParser()
    add_config_arguments(p, (_PastedFlags,))
    values = vars(p.parse_args(["--trust-remote-code"]))
    flags = config_from(_PastedFlags, values)
    assert knob_notices(flags) == [
        "--trust-remote-code has no effect here: iterserve runs its own model code"]
    assert knob_notices(config_from(_PastedFlags, vars(p.parse_args([])))) == []


def test_a_refused_knob_is_a_config_error_naming_its_flag_and_what_it_needs():
    p = argparse.ArgumentParser()
    add_config_arguments(p, (_PastedFlags,))
    with pytest.raises(ConfigError, match=r"--enable-lora: LoRA adapters are not supported "
                                          r"yet \(issue 99\)") as e:
        config_from(_PastedFlags, vars(p.parse_args(["--enable-lora"])))
    assert e.value.knob == "enable_lora"
    with pytest.raises(ConfigError, match="--max-loras: needs --enable-lora"):
        config_from(_PastedFlags, vars(p.parse_args(["--max-loras", "4"])))
    assert config_from(_PastedFlags, vars(p.parse_args(["--max-loras", "1"]))).max_loras == 1


def test_knob_notices_read_engine_args_too():
    @dataclass
    class Args:
        x: int | None = dataclasses.field(default=None, metadata={"knob": knob(
            0, "x", int, no_effect="nothing reads x").metadata["knob"]})

    assert knob_notices(Args()) == []
    assert knob_notices(Args(x=3)) == ["--x has no effect here: nothing reads x"]


def test_a_knob_name_is_declared_once():
    names = [name for cls in config.ALL_CONFIGS for name, _, _ in knob_fields(cls)]
    assert len(names) == len(set(names))
    assert len(config.schema()) == len(names)


def test_per_device_declares_the_cpu_value_as_the_field_default():
    @dataclass
    class C:
        n: int = knob(per_device(2, cuda=8), "n", int)

    assert C().n == 2
    (name, default, k), = knob_fields(C)
    assert (default, k.device_default.on("cuda:3"), k.late_default) == (2, 8, True)
    assert "2 on CPU; 8 on CUDA" in " ".join(
        _help_of(C).split())


def _help_of(cls) -> str:
    p = argparse.ArgumentParser()
    add_config_arguments(p, (cls,))
    return p.format_help()


def test_serve_logs_a_notice_at_start(monkeypatch, caplog):
    """build_app logs knob_notices once, before the engine is built."""
    from iterserve.server import cli

    monkeypatch.setattr(cli, "knob_notices", lambda *configs: ["--x has no effect here: y"])

    class Stop(Exception):
        pass

    def no_engine(*a, **kw):
        raise Stop

    monkeypatch.setattr("iterserve.engine.async_engine.AsyncEngine.from_engine_args", no_engine)
    args = _parser("serve").parse_args(["--model", "/nonexistent"])
    with caplog.at_level(logging.WARNING, logger="iterserve.serve"), pytest.raises(Stop):
        cli.build_app(args)
    assert [r.getMessage() for r in caplog.records] == ["--x has no effect here: y"]


def test_every_flag_the_readme_knob_table_names_exists():
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    table = readme.split("### The scheduler's knobs", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]+|-[a-z]{2})(?![\w-])", table))
    flags = _flags(_parser("serve"))
    assert named and not named - set(flags), sorted(named - set(flags))


def test_a_repeatable_knob_is_a_list_of_checked_values():
    p = _parser("generate")
    args = p.parse_args(["hi", "--stop", "a", "--stop", "b"])
    assert config_from(GenerateConfig, vars(args)).stop == ["a", "b"]
    assert config_from(GenerateConfig, vars(p.parse_args(["hi"]))).stop is None
    with pytest.raises(ConfigError, match="stop must be a string"):
        config_from(GenerateConfig, {"stop": ["a", 3]})
