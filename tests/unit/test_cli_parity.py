"""`tokenspout serve` parses like `vllm serve` (parse only, no server): the positional model, unknown flags named
with the closest known one (no prefix matching), the auth / CORS flags and --chat-template."""

from __future__ import annotations

import pytest

from tokenspout.engine.chat_template import load_chat_template
from tokenspout.entrypoints.cli import build_parser, engine_kwargs
from tokenspout.entrypoints.cli_args import API_KEY_ENV, parse_cli, server_app_options


def parse(*argv: str):
    return parse_cli(*build_parser(), list(argv))


def parse_error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exc:
        parse(*argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_model_is_positional_or_flag():
    assert parse("serve", "/models/a").model == "/models/a"
    assert parse("serve", "--model", "/models/a").model == "/models/a"
    assert parse("serve", "/models/a", "--port", "9000").port == 9000
    assert parse("serve", "/models/a", "--model", "/models/a").model == "/models/a"
    assert parse("serve").model is None  # the default model


def test_two_different_models_is_an_error(capsys):
    err = parse_error(capsys, "serve", "/models/a", "--model", "/models/b")
    assert "/models/a" in err and "/models/b" in err


@pytest.mark.parametrize(("argv", "unknown", "suggestion"), [
    (("serve", "--max-model-length", "512"), "--max-model-length", "--max-model-len"),
    (("serve", "--max-model", "512"), "--max-model", "--max-model-len"),  # a prefix is not accepted
    (("serve", "--api-keys=k"), "--api-keys", "--api-key"),
    (("serve", "--allowed-origin", '["*"]'), "--allowed-origin", "--allowed-origins"),
    (("generate", "hi", "--temprature", "1"), "--temprature", "--temperature"),
])
def test_unknown_flag_names_the_closest(capsys, argv, unknown, suggestion):
    err = parse_error(capsys, *argv)
    assert f"unknown flag {unknown}; did you mean {suggestion}?" in err


def test_unknown_flag_without_a_close_one(capsys):
    err = parse_error(capsys, "serve", "--zzzzqqq")
    assert "unknown flag --zzzzqqq" in err and "did you mean" not in err


def test_api_key_flag_env_and_several_keys():
    assert server_app_options(parse("serve"), {})["api_key"] is None
    assert server_app_options(parse("serve"), {})["playground"] is True
    assert server_app_options(parse("serve", "--no-playground"), {})["playground"] is False
    assert server_app_options(parse("serve"), {API_KEY_ENV: "from-env"})["api_key"] == ["from-env"]
    assert server_app_options(parse("serve", "--api-key", "flag"), {API_KEY_ENV: "env"})["api_key"] == ["flag"]
    args = parse("serve", "/m", "--api-key", "k1", "k2", "--api-key", "k3")
    assert args.model == "/m" and server_app_options(args, {})["api_key"] == ["k1", "k2", "k3"]


def test_cors_flags(capsys):
    opts = server_app_options(parse("serve"), {})
    assert opts["allowed_origins"] is None and opts["allow_credentials"] is False  # no CORS unless asked
    args = parse("serve", "--allowed-origins", '["https://a.example", "https://b.example"]',
                 "--allowed-methods", '["GET", "POST"]', "--allowed-headers", '["authorization"]',
                 "--allow-credentials")
    opts = server_app_options(args, {})
    assert opts["allowed_origins"] == ["https://a.example", "https://b.example"]
    assert opts["allowed_methods"] == ["GET", "POST"] and opts["allowed_headers"] == ["authorization"]
    assert opts["allow_credentials"] is True
    assert parse("serve", "--allowed-origins", "*").allowed_origins == ["*"]
    assert "--allowed-origins" in parse_error(capsys, "serve", "--allowed-origins", '["a", 1]')


def test_server_options_are_build_app_keywords():
    from tests.unit.fake_engine import FakeEngine
    from tokenspout.entrypoints.openai.api_server import build_app

    args = parse("serve", "--api-key", "k", "--allowed-origins", '["*"]')
    build_app(FakeEngine(), **server_app_options(args, {}))


def test_chat_template_flag_reaches_the_engine_config(tmp_path):
    assert engine_kwargs(parse("serve"))["chat_template"] is None
    assert engine_kwargs(parse("generate", "hi", "--chat-template", "t.jinja"))["chat_template"] == "t.jinja"
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    assert engine_kwargs(parse("serve", "--chat-template", str(f)))["chat_template"] == str(f)


def test_load_chat_template_file_or_text(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0]['content'] }}é\n")
    assert load_chat_template(str(f)) == "{{ messages[0]['content'] }}é\n"
    assert load_chat_template(None) is None
    # Inline text: escapes decoded (a one-line template on the command line), other characters kept.
    assert load_chat_template(r"{{ messages[0]['content'] }}\né") == "{{ messages[0]['content'] }}\né"
    with pytest.raises(ValueError, match="looks like a file path"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        load_chat_template("{% for m in messages %}")


def test_vllm_server_flags(tmp_path):
    """--enable-force-include-usage, --return-tokens-as-token-ids, --root-path, --uds (vLLM's) and the response
    store's bounds parse and reach build_app / run_server."""
    args = parse("serve", "--enable-force-include-usage", "--return-tokens-as-token-ids", "--root-path", "/llm",
                 "--uds", str(tmp_path / "s.sock"), "--max-stored-responses", "7",
                 "--max-stored-response-bytes", "4096")
    options = server_app_options(args, {})
    assert options["force_include_usage"] and options["return_tokens_as_token_ids"]
    assert (options["max_stored_responses"], options["max_stored_response_bytes"]) == (7, 4096)
    assert (args.root_path, args.uds) == ("/llm", str(tmp_path / "s.sock"))
    defaults = server_app_options(parse("serve"), {})
    assert not defaults["force_include_usage"] and not defaults["return_tokens_as_token_ids"]
