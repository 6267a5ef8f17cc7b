"""`dlora serve` takes the `vllm serve` flags it shares with vLLM, each landing in the config key it
maps to (on top of the YAML file), and refuses every other vLLM flag by name. Parsed and loaded as
`run` does (dlora.cli's parser, then `load_config`); nothing is started."""

from __future__ import annotations

import functools
import json
import subprocess
import sys

import pytest

from dlora import cli, config
from dlora.app import serve_flags, start_checks
from dlora.config import ConfigError
from dlora.server.auth import authorized


def parse(*argv: str):
    args, extra = cli.build_parser().parse_known_args(["serve", *argv])
    assert not extra, extra
    return args


def load(*argv: str) -> config.DloraConfig:
    return serve_flags.load_config(parse(*argv))


def value_at(cfg: config.DloraConfig, key: str):
    return functools.reduce(getattr, key.split("."), cfg)


def main_stderr(capsys, *argv: str) -> tuple[int, str]:
    """dlora's exit code and stderr for `dlora serve ARGV`, for command lines refused before
    anything starts."""
    try:
        code = cli.main(["serve", *argv])
    except SystemExit as e:  # argparse's own errors exit
        code = e.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, key, value",
    [
        (["/models/m"], "model.path", "/models/m"),
        (["--model", "/models/m"], "model.path", "/models/m"),
        (["/models/m", "--model", "/models/m"], "model.path", "/models/m"),
        (["--served-model-name", "base"], "model.served_name", "base"),
        (["--dtype", "float16"], "model.dtype", "float16"),
        (["--dtype", "half"], "model.dtype", "float16"),
        (["--dtype", "float"], "model.dtype", "float32"),
        (["--max-model-len", "4096"], "model.max_model_len", 4096),
        (["--max-model-len", "4k"], "model.max_model_len", 4000),
        (["--max-model-len", "4K"], "model.max_model_len", 4096),
        (["--max-model-len", "1.5k"], "model.max_model_len", 1500),
        (["--seed", "7"], "model.seed", 7),
        (["--generation-config", "vllm"], "model.generation_config", "vllm"),
        (["--max-loras", "2"], "engine.max_loras", 2),
        (["--max-lora-rank", "64"], "engine.max_lora_rank", 64),
        (["--max-cpu-loras", "32"], "engine.max_cpu_loras", 32),
        (["--max-num-seqs", "8"], "engine.max_num_seqs", 8),
        (["--no-enable-prefix-caching"], "engine.enable_prefix_caching", False),
        (["--host", "0.0.0.0"], "server.host", "0.0.0.0"),
        (["--port", "9001"], "server.port", 9001),
        (["--api-key", "k1"], "server.api_key", ("k1",)),
        (["--api-key", "k1", "k2"], "server.api_key", ("k1", "k2")),
        (["--api-key", "k1", "--api-key", "k2"], "server.api_key", ("k1", "k2")),
        (["--chat-template", "{{ messages }}"], "server.chat_template", "{{ messages }}"),
        (["--trust-request-chat-template"], "server.trust_request_chat_template", True),
        (["--tool-call-parser", "hermes"], "server.tool_call_parser", "hermes"),
        (["--enable-auto-tool-choice", "--tool-call-parser", "hermes"], "server.enable_auto_tool_choice", True),
        (["--reasoning-parser", "deepseek_r1"], "server.reasoning_parser", "deepseek_r1"),
        (["--log-level", "debug"], "server.log_level", "debug"),
        (["--log-level", "DEBUG"], "server.log_level", "debug"),
        (["--structured-outputs-config.backend", "guidance"], "engine.structured_outputs_backend", "guidance"),
        (
            ["--structured-outputs-config.backend", "xgrammar", "--structured-outputs-config.disable_any_whitespace"],
            "engine.structured_outputs_disable_any_whitespace",
            True,
        ),
        (
            ["--structured-outputs-config.backend=xgrammar", "--structured-outputs-config.disable_any_whitespace=true"],
            "engine.structured_outputs_disable_any_whitespace",
            True,
        ),
        (
            ["--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}'],
            "engine.structured_outputs_disable_any_whitespace",
            True,
        ),
    ],
)
def test_each_vllm_flag_sets_its_config_key(argv, key, value):
    assert value_at(config.load(None), key) != value  # the flag, not the default, put it there
    assert value_at(load(*argv), key) == value


@pytest.mark.parametrize("argv", [["--enable-lora"], ["--tensor-parallel-size", "1"], ["-tp", "1"]])
def test_vllm_flags_that_change_nothing_in_dlora_are_accepted(argv):
    assert load(*argv) == config.load(None)


def test_flags_override_the_yaml_and_the_yaml_fills_the_rest(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(
        """
model: {path: /models/from-yaml, served_name: yaml-name, max_model_len: 1024}
engine: {max_num_seqs: 16, enable_prefix_caching: false}
server: {port: 9100, api_key: [y1, y2], trust_request_chat_template: true}
"""
    )
    cfg = load("--config", str(cfg_file), "/models/from-flag", "--served-model-name", "flag-name", "--port", "9200")
    assert (cfg.model.path, cfg.model.served_name, cfg.server.port) == ("/models/from-flag", "flag-name", 9200)
    # Keys no flag set keep the file's values, booleans included (a flag left out is no `false`).
    assert (cfg.model.max_model_len, cfg.engine.max_num_seqs) == (1024, 16)
    assert cfg.engine.enable_prefix_caching is False and cfg.server.trust_request_chat_template is True
    assert cfg.server.api_key == ("y1", "y2")
    assert load("--config", str(cfg_file), "--api-key", "f1").server.api_key == ("f1",)
    assert load("--config", str(cfg_file), "--enable-prefix-caching").engine.enable_prefix_caching is True


def test_related_flags_are_checked_together():
    """A section's flags are applied at once: raising max_loras past the default max_cpu_loras is
    fine when max_cpu_loras rises with it, whatever the order on the command line."""
    cfg = load("--max-loras", "32", "--max-cpu-loras", "64")
    assert (cfg.engine.max_loras, cfg.engine.max_cpu_loras) == (32, 64)
    cfg = load("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    assert cfg.server.enable_auto_tool_choice and cfg.server.tool_call_parser == "hermes"


def test_lora_modules_in_both_of_vllms_forms_follow_the_yaml_adapters(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("model: {path: /models/m, served_name: base}\nadapters: [{name: a, path: /adapters/a}]\n")
    item = json.dumps({"name": "c", "path": "/adapters/c", "base_model_name": "base"})
    cfg = load(
        "--config", str(cfg_file), "--lora-modules", "b=rel/b", item, "--lora-modules", '{"name":"d","path":"d"}'
    )
    assert [(a.name, a.path, a.pinned) for a in cfg.adapters] == [
        ("a", "/adapters/a", False),
        ("b", str(tmp_path / "rel" / "b"), False),  # relative to the working directory, as in vLLM
        ("c", "/adapters/c", False),
        ("d", str(tmp_path / "d"), False),
    ]


def test_a_lora_base_model_name_may_name_the_model_as_given_when_no_served_name_is_set():
    cfg = load("/models/m", "--lora-modules", json.dumps({"name": "a", "path": "/a", "base_model_name": "/models/m"}))
    assert [a.name for a in cfg.adapters] == ["a"]
    cfg = load("/models/m", "--lora-modules", json.dumps({"name": "a", "path": "/a", "base_model_name": "m"}))
    assert [a.name for a in cfg.adapters] == ["a"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["/m/a", "--model", "/m/b"], "MODEL '/m/a' and --model '/m/b' differ: give the model once"),
        (["--served-model-name", "a", "b"], "--served-model-name a b: dlora serves the base model under one name"),
        (
            ["--tensor-parallel-size", "2"],
            "--tensor-parallel-size 2: dlora runs each replica on one device; serve on more devices with more "
            "replicas (--num-replicas)",
        ),
        (["-tp", "4"], "--tensor-parallel-size 4: dlora runs each replica on one device"),
        (
            ["--enable-auto-tool-choice"],
            "server.enable_auto_tool_choice=True: needs server.tool_call_parser (--tool-call-parser), as vLLM's "
            "--enable-auto-tool-choice does",
        ),
        (
            ["--served-model-name", "base", "--lora-modules", '{"name": "a", "path": "/a", "base_model_name": "b"}'],
            "--lora-modules a: base_model_name 'b' is not the served model ('base'); dlora serves adapters of one "
            "base model",
        ),
        (["--lora-modules", "a=/a", "a=/b"], "--lora-modules a: an adapter of that name is already configured"),
        (["--lora-modules", "{not json"], "--lora-modules '{not json': neither name=path nor a JSON object"),
        (
            ["--lora-modules", '{"name": "a"}'],
            """--lora-modules '{"name": "a"}': a JSON item is an object with name, path and optionally """
            "base_model_name",
        ),
        (
            ["--lora-modules", '{"name": "a", "path": "/a", "rank": 8}'],
            """--lora-modules '{"name": "a", "path": "/a",""",
        ),
        (["--lora-modules", "=/a"], "--lora-modules '=/a': name and path must be non-empty strings"),
        (["--max-lora-rank", "7"], "engine.max_lora_rank=7"),
        (
            ["--structured-outputs-config", '{"backend": "xgrammar", "enable_in_reasoning": true}'],
            "--structured-outputs-config: dlora does not take enable_in_reasoning",
        ),
        (["--structured-outputs-config", "[1]"], "--structured-outputs-config '[1]': not a JSON object"),
        (
            ["--structured-outputs-config.disable_any_whitespace"],
            "engine.structured_outputs_disable_any_whitespace=True",
        ),
    ],
)
def test_refused_values_are_one_line_exit_2(capsys, argv, message):
    code, err = main_stderr(capsys, *argv)
    assert code == 2
    assert err.startswith(f"dlora serve: error: {message}") and err.count("\n") == 1, err


def test_a_lora_module_named_like_a_yaml_adapter_is_refused(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("adapters: [{name: a, path: /adapters/a}]\n")
    with pytest.raises(ConfigError, match="^--lora-modules a: an adapter of that name is already configured$"):
        load("--config", str(cfg_file), "--lora-modules", "a=/elsewhere")


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--enforce-eager"], "--enforce-eager"),
        (["--gpu-memory-utilization", "0.9"], "--gpu-memory-utilization"),
        (["--gpu-memory-utilization=0.9"], "--gpu-memory-utilization"),
        (["--gpu_memory_utilization", "0.9"], "--gpu-memory-utilization"),
        (["/models/m", "--pipeline-parallel-size", "2", "--port", "9000"], "--pipeline-parallel-size"),
        (["--compilation-config.mode", "3"], "--compilation-config"),
        (["-pp", "2"], "-pp"),
        (["-O3"], "-O"),
        (["--no-enable-lora"], "--no-enable-lora"),
        (["--tokenizer-mode", "slow", "--no-such-flag-anywhere"], "--tokenizer-mode"),
    ],
)
def test_other_vllm_flags_are_refused_by_name(capsys, argv, flag):
    assert main_stderr(capsys, *argv) == (2, f"dlora serve: error: vLLM's {flag} is not supported by dlora\n")


def test_the_command_refuses_a_vllm_flag_in_one_line_on_stderr():
    """As a user sees it: vLLM's import-time warnings, which a test process's logging would catch,
    do not reach stderr."""
    r = subprocess.run(
        [sys.executable, "-m", "dlora.cli", "serve", "/models/m", "--enforce-eager", "--port", "9000"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (r.returncode, r.stderr) == (2, "dlora serve: error: vLLM's --enforce-eager is not supported by dlora\n")


def test_a_dlora_flag_written_with_underscores_is_named_with_its_dashes(capsys):
    code, err = main_stderr(capsys, "--max_num_seqs", "8")
    assert (code, err) == (2, "dlora serve: error: --max_num_seqs: dlora takes it as --max-num-seqs\n")


def test_a_flag_neither_tool_knows_keeps_argparses_error(capsys):
    code, err = main_stderr(capsys, "--no-such-flag-anywhere")
    assert (code, err) == (2, "dlora serve: error: unrecognized arguments: --no-such-flag-anywhere (see --help)\n")


def test_every_vllm_flag_dlora_takes_is_one_of_vllms():
    """The flags in dlora's `vLLM's flags` group are spelt as vLLM spells them."""
    parser = cli.build_parser()
    serve = next(a for a in parser._actions if a.choices and "serve" in a.choices).choices["serve"]
    group = next(g for g in serve._action_groups if g.title == "vLLM's flags")
    taken = {option for action in group._group_actions for option in action.option_strings}
    assert "--lora-modules" in taken and "--no-enable-prefix-caching" in taken
    # vLLM's parser also takes one key of a config flag as --flag.key
    assert {flag.split(".")[0] for flag in taken} - serve_flags.vllm_serve_flags() == set()


def test_no_vllm_flag_dlora_refuses_is_taken_as_an_abbreviation_of_a_dlora_flag():
    """argparse takes a unique prefix of a flag as that flag, so such a vLLM flag would set a dlora
    key silently instead of being refused."""
    own = serve_cmd_flags()
    vllm = serve_flags.vllm_serve_flags()
    assert {f for f in vllm - own if f.startswith("--") and any(o.startswith(f) for o in own)} == set()


def serve_cmd_flags() -> set[str]:
    parser = cli.build_parser()
    serve = next(a for a in parser._actions if a.choices and "serve" in a.choices).choices["serve"]
    return {option for action in serve._actions for option in action.option_strings}


@pytest.mark.parametrize(
    "key, name, needle",
    [
        ("server.tool_call_parser", "no-such-parser", "vLLM has no such tool call parser; it has "),
        ("server.reasoning_parser", "no-such-parser", "vLLM has no such reasoning parser; it has "),
    ],
)
def test_parser_names_are_checked_against_vllms_registries(key, name, needle):
    cfg = config.override(config.load(None), {key: name})
    with pytest.raises(ConfigError) as e:
        start_checks.check_frontend_options(cfg)
    message = str(e.value)
    assert message.startswith(f"{key}='{name}': {needle}") and "\n" not in message
    assert ("hermes" if "tool" in key else "deepseek_r1") in message  # the valid names are listed


def test_known_parser_names_pass():
    cfg = config.override(
        config.load(None), {"server.tool_call_parser": "hermes", "server.reasoning_parser": "deepseek_r1"}
    )
    start_checks.check_frontend_options(cfg)


def test_chat_template_and_generation_config_are_checked(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages }}")
    for value in (str(template), "{{ messages[0].content }}"):
        start_checks.check_frontend_options(config.override(config.load(None), {"server.chat_template": value}))
    with pytest.raises(ConfigError, match=r"^server.chat_template='/no/such/t.jinja': .*doesn't exist"):
        start_checks.check_frontend_options(
            config.override(config.load(None), {"server.chat_template": "/no/such/t.jinja"})
        )
    for value in ("auto", "vllm", str(tmp_path)):
        start_checks.check_frontend_options(config.override(config.load(None), {"model.generation_config": value}))
    with pytest.raises(ConfigError, match=r"^model.generation_config='/no/such/dir': must be auto, vllm or a dir"):
        start_checks.check_frontend_options(
            config.override(config.load(None), {"model.generation_config": "/no/such/dir"})
        )


def test_an_admin_token_that_is_also_an_api_key_is_refused(monkeypatch):
    monkeypatch.delenv("DLORA_ADMIN_TOKEN", raising=False)
    monkeypatch.delenv("DLORA_API_KEY", raising=False)
    same = config.override(config.load(None), {"server.api_key": ["k1", "k2"], "server.admin_token": "k2"})
    with pytest.raises(ConfigError, match=r"^server.admin_token \(or DLORA_ADMIN_TOKEN\) equals one of server.api_key"):
        start_checks.check_credentials(same)
    start_checks.check_credentials(config.override(same, {"server.admin_token": "admin"}))
    monkeypatch.setenv("DLORA_API_KEY", "admin")  # the environment's key counts too
    with pytest.raises(ConfigError):
        start_checks.check_credentials(config.override(same, {"server.admin_token": "admin"}))


def test_yaml_paths_of_the_templates_resolve_against_the_config_file(tmp_path):
    (tmp_path / "t.jinja").write_text("{{ messages }}")
    (tmp_path / "gen").mkdir()
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("model: {generation_config: gen}\nserver: {chat_template: t.jinja}\n")
    cfg = config.load(cfg_file)
    assert cfg.model.generation_config == str(tmp_path / "gen")
    assert cfg.server.chat_template == str(tmp_path / "t.jinja")
    inline = "{% for m in messages %}{{ m.content }}{% endfor %}"
    cfg = config.from_dict({"server": {"chat_template": inline}, "model": {"generation_config": "vllm"}}, tmp_path)
    assert (cfg.server.chat_template, cfg.model.generation_config) == (inline, "vllm")


@pytest.mark.parametrize(
    "yaml_value, keys",
    [("one-key", ("one-key",)), (["k1", "k2"], ("k1", "k2")), (None, ()), ([], ())],
)
def test_api_key_is_one_key_or_a_list_in_yaml(yaml_value, keys, monkeypatch):
    monkeypatch.delenv("DLORA_API_KEY", raising=False)
    cfg = config.from_dict({"server": {"api_key": yaml_value}})
    assert cfg.server.api_key == keys and cfg.api_key == keys


@pytest.mark.parametrize("bad", ["", ["k1", ""], ["k1", 2], 5, {"k": "v"}])
def test_api_key_must_be_non_empty_strings(bad):
    with pytest.raises(ConfigError, match=r"^server.api_key=.*: must be a non-empty string, a list of them, or null$"):
        config.from_dict({"server": {"api_key": bad}})


def test_the_api_key_env_variable_is_one_key_replacing_the_configured_ones(monkeypatch):
    cfg = config.from_dict({"server": {"api_key": ["k1", "k2"]}})
    monkeypatch.setenv("DLORA_API_KEY", "env-key")
    assert cfg.api_key == ("env-key",)


def test_any_configured_key_is_authorized():
    keys = ("k1", "k2")
    assert authorized("Bearer k1", keys) and authorized("Bearer k2", keys) and authorized("bearer  k2 ", keys)
    assert not authorized("Bearer k3", keys)
    assert not authorized("Bearer k1k2", keys)
    assert not authorized("", keys) and not authorized("Basic k1", keys)
    assert authorized("", ()) and authorized("", None)  # no key: open
    assert authorized("Bearer one", "one") and not authorized("Bearer two", "one")
