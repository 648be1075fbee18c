"""`pdserve up` as a user runs it: the whole local stack from one command, stopped by Ctrl-C,
torn down when a child dies, and a clear message when redis-server is missing; and the command
lines it builds: every worker and gateway flag passes through, --prefill-args & co. override."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve import cli
from pdserve.launcher import GatewayProbe, child_commands, hand_over_api_keys, worker_threads
from tests.stack import free_port
from tests.up_process import STOP_TIMEOUT_S, Up, assert_all_gone, stream_chat

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def up(model_dir, tmp_path):
    u = Up(model_dir, tmp_path)
    yield u
    u.kill()


@pytest.mark.slow
def test_up_serves_then_ctrl_c_stops_everything(up):
    """`make serve` is `pdserve up`: it answers the official client's streamed chat, and
    Ctrl-C stops every process it started (no orphans, every port free) with exit code 0."""
    import openai

    up.wait_ready()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{up.ports['http']}/v1", api_key="none",
                           timeout=120, max_retries=0)
    assert "Paris" in stream_chat(client, "What is the capital of France?")

    code, children = up.stop(signal.SIGINT)
    assert code == 0, up.output()[-3000:]
    assert_all_gone(up, children)


@pytest.mark.slow
def test_up_api_key_guards_the_gateway_and_stays_off_every_command_line(model_dir, tmp_path):
    """`pdserve up --api-key KEY` (vLLM's spelling): the gateway wants that key (401 without
    it) and the key is on no child's command line and not in `up`'s log."""
    import httpx

    key = "sk-up-flag-key"
    up = Up(model_dir, tmp_path, "--api-key", key)
    try:
        up.wait_ready()
        assert "(API keys required)" in up.output()
        base = f"http://127.0.0.1:{up.ports['http']}/v1"
        assert httpx.get(base + "/models", timeout=30).status_code == 401
        ok = httpx.get(base + "/models", timeout=30, headers={"Authorization": f"Bearer {key}"})
        assert ok.status_code == 200, ok.text
        for name, pid in up.children().items():
            assert key not in Path(f"/proc/{pid}/cmdline").read_bytes().decode(), name
        assert key not in up.output()
    finally:
        up.kill()


@pytest.mark.slow
def test_up_stops_the_stack_and_fails_when_a_child_dies(up):
    up.wait_ready()
    children = up.children()
    os.kill(children["decode"], signal.SIGKILL)
    assert up.proc.wait(timeout=STOP_TIMEOUT_S) == 1
    assert "decode exited with code -9" in up.output()
    assert_all_gone(up, children)


def test_up_without_redis_server_says_how_to_install_it(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    env = dict(os.environ, PATH=str(tmp_path),  # no redis-server on this PATH
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "pdserve.cli", "up", "--model", str(model),
                           "--redis-port", str(free_port())],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert proc.returncode != 0
    assert "apt-get install redis-server" in proc.stderr


# ---- the command lines `pdserve up` builds ----------------------------------------------------

# Per-process flags `up` owns for each child; shared ones every child gets from `up`'s own.
WORKER_PLUMBING = {"--host", "--port", "--worker-id", "--redis-url", "--advertise-host",
                   "--metrics-port"}
GATEWAY_PLUMBING = {"--host", "--http-port", "--grpc-port", "--redis-url",
                    "--api-key"}       # a secret: `up` hands keys over in $PDSERVE_API_KEY
SHARED = {"--model", "--served-model-name", "--log-level"}
MODEL = Path("/models/smol")
REDIS = "redis://127.0.0.1:6390/0"
CHILD_PREFIX = 4                       # python -m pdserve.cli ROLE


def _subcommand(name: str) -> argparse.ArgumentParser:
    """The parser of `pdserve NAME`, as `pdserve` itself builds it."""
    parser = cli.build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subs.choices[name]


def _flags(role: str) -> list[argparse.Action]:
    skip = SHARED | (GATEWAY_PLUMBING if role == "gateway" else WORKER_PLUMBING)
    return [a for a in _subcommand(role)._actions
            if a.option_strings and a.dest != "help" and not set(a.option_strings) & skip]


def _commands(*up_argv: str, num_gpus: int = 1) -> dict[str, list[str]]:
    args = cli.build_parser().parse_args(["up", *up_argv])
    return child_commands(args, MODEL, REDIS, num_gpus=num_gpus)


def _parsed(commands: dict[str, list[str]], role: str) -> argparse.Namespace:
    """A child's command line read back by that role's own parser (it must parse)."""
    cmd = commands[role]
    assert cmd[:CHILD_PREFIX] == [sys.executable, "-m", "pdserve.cli", role]
    return _subcommand(role).parse_args(cmd[CHILD_PREFIX:])


def _non_default(action: argparse.Action) -> tuple[list[str], object]:
    """An `up` argv giving ACTION a value that is not its default, and the value it parses to."""
    flag = next(o for o in action.option_strings if o.startswith("--"))
    if action.nargs == 0:
        return [flag], action.const
    if action.nargs == "+":               # (--lora-modules NAME=PATH ...)
        texts = ["a=/x/a", "b=/y/b"]
        return [flag, *texts], [action.type(t) for t in texts]
    if action.choices:
        value = next(c for c in action.choices if c != action.default)
        return [flag, value], value
    if action.type is float:
        text = "0.375" if action.default != 0.375 else "0.625"
    elif action.type is not None:         # int, or a checked int such as a non-negative one
        text = str((action.default or 0) + 3)
    else:
        text = "value-x"
    return [flag, text], (action.type or str)(text)


WORKER_FLAGS = [(role, a) for role in ("prefill", "decode") for a in _flags(role)]


def test_the_passthrough_list_is_not_empty():
    """Guards the derivation below: the parsers are found and hold the flags we know of."""
    names = {o for _, a in WORKER_FLAGS for o in a.option_strings}
    assert {"--block-size", "--kv-transport", "--speculative", "--kv-load-failure",
            "--no-prefix-cache", "--device", "--max-num-seqs"} <= names
    assert not names & WORKER_PLUMBING


@pytest.mark.parametrize("role,action", WORKER_FLAGS,
                         ids=[f"{r}{a.option_strings[-1]}" for r, a in WORKER_FLAGS])
def test_every_worker_flag_is_reachable_from_up(role, action):
    """Every flag of `pdserve prefill`/`decode` (but the per-process ones) given to `up` reaches
    that worker, and the other worker too when it has the flag; a later flag without
    passthrough fails here."""
    argv, value = _non_default(action)
    commands = _commands(*argv)
    assert getattr(_parsed(commands, role), action.dest) == value
    other = "decode" if role == "prefill" else "prefill"
    other_flags = {o for a in _flags(other) for o in a.option_strings}
    other_ns = _parsed(commands, other)              # parses: nothing foreign leaked into it
    if argv[0] in other_flags:
        assert getattr(other_ns, action.dest) == value
    else:
        assert argv[0] not in " ".join(commands[other])


GATEWAY_FLAGS = _flags("gateway")


@pytest.mark.parametrize("action", GATEWAY_FLAGS, ids=[a.option_strings[-1] for a in GATEWAY_FLAGS])
def test_every_gateway_flag_is_reachable_from_up(action):
    argv, value = _non_default(action)
    commands = _commands(*argv)
    assert getattr(_parsed(commands, "gateway"), action.dest) == value
    for role in ("prefill", "decode"):
        _parsed(commands, role)


def test_gateway_flags_reach_the_gateway_command_line():
    commands = _commands("--routing", "load", "--local-prefill-max-tokens", "96",
                         "--local-prefill-queue", "2", "--max-model-len", "512",
                         "--max-tokens-default", "300", "--tool-call-parser", "hermes")
    gw = _parsed(commands, "gateway")
    assert (gw.routing, gw.local_prefill_max_tokens, gw.local_prefill_queue, gw.max_model_len,
            gw.max_tokens_default, gw.tool_call_parser) == ("load", 96, 2, 512, 300, "hermes")
    # --max-model-len is a worker flag too: one `up` flag, the same limit everywhere
    assert _parsed(commands, "prefill").max_model_len == 512
    assert _parsed(commands, "decode").max_model_len == 512
    assert "--routing" not in " ".join(commands["prefill"] + commands["decode"])


@pytest.mark.parametrize("role", ["prefill", "decode", "gateway"])
def test_flags_not_given_keep_each_processs_defaults(role):
    """A bare `pdserve up`: each child differs from its own defaults only in what `up` sets."""
    got = vars(_parsed(_commands(), role))
    defaults = vars(_subcommand(role).parse_args([]))
    differ = {k for k in defaults if got[k] != defaults[k]}
    owned = ({"model", "log_level", "http_port", "grpc_port", "redis_url"} if role == "gateway"
             else {"model", "log_level", "port", "redis_url", "threads"})
    assert differ <= owned
    assert got["model"] == str(MODEL) and got["redis_url"] == REDIS
    if role != "gateway":
        cores = len(os.sched_getaffinity(0))     # both workers take the host's cores
        assert (got["threads"], got["device"], got["gpu_memory_utilization"]) \
            == (cores, "cpu", 0.9)


def test_threads_default_to_the_hosts_cores_on_cpus_and_1_on_gpus(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert worker_threads(0, "cpu") == 8 and worker_threads(0, "cpu", 2) == 4
    assert worker_threads(0, "cpu", 16) == 1
    assert worker_threads(0, "cuda:1") == 1 and worker_threads(3, "cpu") == 3
    tp = _commands("--tensor-parallel-size", "2")
    assert _parsed(tp, "prefill").threads == _parsed(tp, "decode").threads == 4
    assert _parsed(_commands("--threads", "1"), "decode").threads == 1
    pinned = _commands("--decode-args=--threads 2")
    assert (_parsed(pinned, "prefill").threads, _parsed(pinned, "decode").threads) == (8, 2)


def test_up_flags_keep_their_meaning():
    two = _commands("--device", "cuda", num_gpus=2)
    assert [(_parsed(two, r).device, _parsed(two, r).gpu_memory_utilization)
            for r in ("prefill", "decode")] == [("cuda:0", 0.9), ("cuda:1", 0.9)]
    one = _commands("--device", "cuda", num_gpus=1)
    assert [(_parsed(one, r).device, _parsed(one, r).gpu_memory_utilization)
            for r in ("prefill", "decode")] == [("cuda:0", 0.45), ("cuda:0", 0.45)]
    split = _commands("--device", "cuda:2,cuda:3", "--gpu-memory-utilization", "0.6")
    assert [(_parsed(split, r).device, _parsed(split, r).gpu_memory_utilization)
            for r in ("prefill", "decode")] == [("cuda:2", 0.6), ("cuda:3", 0.6)]
    commands = _commands("--threads", "2", "--dtype", "bfloat16", "--kv-cache-gib", "0.25",
                         "--attention-backend", "torch", "--enforce-eager", "--no-prefix-cache",
                         "--speculative", "ngram", "--served-model-name", "smol")
    for role in ("prefill", "decode"):
        ns = _parsed(commands, role)
        assert (ns.threads, ns.dtype, ns.kv_cache_gib, ns.attention_backend, ns.enforce_eager,
                ns.prefix_cache, ns.served_model_name) == (2, "bfloat16", 0.25, "torch", True,
                                                           False, "smol")
    assert _parsed(commands, "decode").speculative == "ngram"
    assert "--speculative" not in " ".join(commands["prefill"])
    assert _parsed(commands, "gateway").served_model_name == "smol"


def test_role_args_override_the_shared_flags():
    commands = _commands("--block-size", "32", "--max-num-seqs", "8", "--routing", "load",
                         "--prefill-args=--enforce-eager --max-num-seqs 4",
                         "--decode-args", "--block-size 64 --device cuda:1",
                         "--gateway-args=--routing round-robin --max-tokens-default 5")
    prefill, decode = _parsed(commands, "prefill"), _parsed(commands, "decode")
    assert (prefill.block_size, prefill.max_num_seqs, prefill.enforce_eager) == (32, 4, True)
    assert (decode.block_size, decode.max_num_seqs, decode.enforce_eager) == (64, 8, False)
    assert (prefill.device, decode.device) == ("cpu", "cuda:1")
    gw = _parsed(commands, "gateway")
    assert (gw.routing, gw.max_tokens_default) == ("round-robin", 5)
    assert commands["decode"][-4:] == ["--block-size", "64", "--device", "cuda:1"]


def test_tensor_parallel_workers_get_their_own_gpus():
    """--device cuda: the decode worker's ranks start after the prefill worker's."""
    commands = _commands("--device", "cuda", "--tensor-parallel-size", "2",
                         "--prefill-args=--tensor-parallel-size 1", num_gpus=3)
    prefill, decode = _parsed(commands, "prefill"), _parsed(commands, "decode")
    assert (prefill.tensor_parallel_size, decode.tensor_parallel_size) == (1, 2)
    assert (prefill.device, decode.device) == ("cuda:0", "cuda:1")
    assert decode.gpu_memory_utilization == 0.9


BAD_ROLE_ARGS = [
    ("--prefill-args=--bogus", "argument --prefill-args: pdserve prefill: unrecognized "
                               "arguments: --bogus"),
    ("--prefill-args=--speculative ngram", "pdserve prefill: unrecognized arguments: "
                                           "--speculative ngram"),
    ("--decode-args=--kv-load-failure maybe", "pdserve decode: argument --kv-load-failure: "
                                              "invalid choice: 'maybe'"),
    ("--decode-args=--block-size big", "pdserve decode: argument --block-size: invalid int "
                                       "value: 'big'"),
    ("--gateway-args=--routing nearest", "pdserve gateway: argument --routing: invalid choice"),
    ("--gateway-args=--max-tokens-default -3", "--max-tokens-default: must be 0 or more"),
    ("--decode-args=--port 1", "--port is set by pdserve up for each process; use pdserve up "
                               "--prefill-port/--decode-port"),
    # no abbreviation is a flag: `--po` is not read as `--port`
    ("--prefill-args=--po 1", "pdserve prefill: unrecognized arguments: --po 1"),
    ("--prefill-args=--redis-url redis://elsewhere", "--redis-url is set by pdserve up"),
    ("--gateway-args=--http-port 1", "--http-port is set by pdserve up"),
    ("--decode-args=--model /other", "--model is set by pdserve up"),
    ("--prefill-args=--block-size '32", "argument --prefill-args: cannot split"),
]


@pytest.mark.parametrize("arg,message", BAD_ROLE_ARGS, ids=[a for a, _ in BAD_ROLE_ARGS])
def test_bad_role_args_fail_fast_with_the_roles_message(capsys, arg, message):
    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args(["up", arg])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "pdserve up: error:" in err and message in err, err


def test_bad_role_args_stop_up_before_anything_starts(tmp_path):
    """The check runs as `up` parses its flags: no Redis, no model check, no child."""
    env = dict(os.environ, PATH=str(tmp_path),  # no redis-server: its error would come first
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "pdserve.cli", "up", "--model",
                           str(tmp_path / "missing"), "--decode-args=--num-speculative-tokens x"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert proc.returncode == 2
    assert ("argument --decode-args: pdserve decode: argument --num-speculative-tokens: invalid "
            "int value: 'x'") in proc.stderr
    assert "redis-server" not in proc.stderr


def test_up_api_keys_reach_the_gateway_in_its_environment(monkeypatch):
    """`up --api-key` keys join those already in $PDSERVE_API_KEY, which the gateway (and the
    probe `up` waits with) reads; no command line holds them."""
    from gateway.auth import ApiKeys

    monkeypatch.setenv("PDSERVE_API_KEY", "sk-env")
    args = cli.build_parser().parse_args(["up", "--api-key", "sk-one", "--api-key", "sk-two",
                                          "--protect-metrics"])
    commands = child_commands(args, MODEL, REDIS, num_gpus=1)
    assert not [a for cmd in commands.values() for a in cmd if "sk-" in a]
    hand_over_api_keys(args)
    assert os.environ["PDSERVE_API_KEY"] == "sk-env,sk-one,sk-two"
    gateway = _parsed(commands, "gateway")
    keys = ApiKeys.from_sources(gateway.api_key, gateway.api_key_file)
    assert all(keys.accepts(f"Bearer {k}") for k in ("sk-env", "sk-one", "sk-two"))
    probe = GatewayProbe.for_gateway(commands["gateway"], 8000)
    assert probe.keyed and probe.headers == {"Authorization": "Bearer sk-env"}


def test_up_refuses_an_api_key_the_environment_cannot_carry(monkeypatch):
    monkeypatch.setenv("PDSERVE_API_KEY", "sk-env")
    args = cli.build_parser().parse_args(["up", "--api-key", "sk-a,b"])
    with pytest.raises(SystemExit, match="a key holding ',' cannot be handed to the gateway"):
        hand_over_api_keys(args)
    assert os.environ["PDSERVE_API_KEY"] == "sk-env"


def test_up_help_describes_every_flag():
    up = _subcommand("up")
    missing = [a.option_strings for a in up._actions if a.option_strings and not a.help]
    assert missing == []
    text = up.format_help()
    for flag in ("--prefill-args", "--decode-args", "--gateway-args", "--kv-load-failure",
                 "--max-tokens-default", "--tool-call-parser"):
        assert flag in text
    words = " ".join(text.split())
    assert "decode worker only" in words and "default: prefill 30.0, decode 300.0" in words


def test_new_gateway_flags_reach_the_served_model(tmp_path):
    from gateway.server import served_model

    (tmp_path / "config.json").write_text('{"max_position_embeddings": 2048}')
    gw = cli.build_parser().parse_args(["gateway"])
    assert (gw.max_tokens_default, gw.tool_call_parser) == (1024, None)
    served = served_model(tmp_path, None, gw.max_model_len, gw.max_tokens_default,
                          gw.tool_call_parser)
    assert (served.max_model_len, served.max_tokens_default, served.tool_call_parser) == \
        (2048, 1024, "")
    gw = cli.build_parser().parse_args(["gateway", "--max-tokens-default", "0",
                                        "--tool-call-parser", "llama3_json"])
    served = served_model(tmp_path, "x", 100, gw.max_tokens_default, gw.tool_call_parser)
    assert (served.max_model_len, served.max_tokens_default, served.tool_call_parser) == \
        (100, 0, "llama3_json")
