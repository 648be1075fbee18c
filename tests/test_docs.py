"""The README and docs/ against the code: the README stays short and starts with `make serve` and
`make test`; its curl and gRPC examples are requests the gateway accepts; every `pdserve` command
line and every `--flag` the pages show exists; every `make` target exists; every relative link
and anchor resolves. No servers: parsers and request models only."""

from __future__ import annotations

import argparse
import json
import re
import shlex
from pathlib import Path

import pytest

from pdserve.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, ROOT / "ARCHITECTURE.md", *DOCS]
# Flags of the modules run by make targets rather than by `pdserve` (KERNELS_AOT_ARGS,
# GPU_CHECK_ARGS): they must be in that module's own parser.
MAKE_MODULES = [ROOT / "pdkernels" / "aot.py", ROOT / "pdserve" / "gpucheck.py"]


def fences(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)


def prose(text: str) -> str:
    """The text outside fenced blocks."""
    return re.sub(r"^```\w*\n.*?^```", "", text, flags=re.S | re.M)


def shell_lines(body: str) -> list[str]:
    """Commands of a shell block: continuation lines joined, comments and output lines dropped."""
    out = []
    for line in body.replace("\\\n", " ").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        out.append(re.sub(r"\s+#\s.*$", "", line))
    return out


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def all_parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for child in subparsers(parser).values():
        found += all_parsers(child)
    return found


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


PARSER = build_parser()
PDSERVE_FLAGS = set().union(*(options(p) for p in all_parsers(PARSER)))
MAKE_FLAGS = {m for path in MAKE_MODULES
              for m in re.findall(r"add_argument\(\"(--[a-z0-9-]+)\"", path.read_text())}


def pdserve_commands() -> list[tuple[Path, str]]:
    """Every `pdserve ...` command line of every page: in shell blocks, and in inline code."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for lang, body in fences(text):
            if lang == "sh":
                found += [(page, line) for line in shell_lines(body)]
        found += [(page, span) for span in re.findall(r"`([^`\n]*pdserve [^`\n]*)`", prose(text))]
    return [(page, line) for page, line in found if re.match(r"([A-Z_]+=\S+ )*pdserve \w", line)]


def test_readme_is_short_and_starts_with_make_serve_and_make_test():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    lang, first = fences(text)[0]
    assert lang == "sh"
    assert [line.split()[:2] for line in shell_lines(first)] == [["make", "serve"], ["make", "test"]]


def test_readme_links_every_page_of_docs():
    text = README.read_text()
    for page in DOCS:
        assert f"(docs/{page.name})" in text, page.name
    assert "(ARCHITECTURE.md)" in text


@pytest.mark.parametrize("page,line", pdserve_commands(), ids=lambda v: getattr(v, "name", v))
def test_every_pdserve_command_shown_parses_its_flags(page, line):
    """Each command's subcommands exist and each --flag is one of that subcommand's (values are
    the page's placeholders, so only the names are checked)."""
    tokens = shlex.split(line)
    while "=" in tokens[0] and not tokens[0].startswith("-"):
        tokens = tokens[1:]                              # VAR=value before the command
    assert tokens[0] == "pdserve"
    parser = PARSER
    for token in tokens[1:]:
        if token.startswith("-"):
            name = token.split("=", 1)[0]
            assert name in options(parser), f"{page.name}: {line!r}: {name} is not a flag here"
        elif token in subparsers(parser):
            parser = subparsers(parser)[token]


def test_every_flag_named_in_the_prose_exists():
    """An inline `--flag` outside code blocks (tables, text) is a flag of some pdserve command or
    of a module a make target runs."""
    missing = []
    for page in PAGES:
        for span in re.findall(r"`(--[a-z0-9-]+)", prose(page.read_text())):
            if span not in PDSERVE_FLAGS | MAKE_FLAGS:
                missing.append(f"{page.name}: {span}")
    assert not missing, missing


def test_every_make_target_named_exists():
    targets = set(re.findall(r"^([a-z][a-z0-9-]*):", (ROOT / "Makefile").read_text(), re.M))
    named = set()
    for page in PAGES:
        text = page.read_text()
        named |= set(re.findall(r"`make ([a-z][a-z0-9-]*)", text))
        named |= set(re.findall(r"^make ([a-z][a-z0-9-]*)", text, re.M))
    assert named and named <= targets, named - targets


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found, seen = set(), {}
    for heading in re.findall(r"^#+ (.*)$", prose(page.read_text()), re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", prose(page.read_text())):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken


def test_the_readme_curl_request_is_one_the_gateway_accepts():
    from gateway.protocol import ChatCompletionRequest

    curl = next(line for lang, body in fences(README.read_text()) if lang == "sh"
                for line in shell_lines(body) if line.startswith("curl"))
    tokens = shlex.split(curl)
    assert tokens[tokens.index("-N") + 1] == "http://127.0.0.1:8000/v1/chat/completions"
    body = json.loads(tokens[tokens.index("-d") + 1])
    assert body["model"] == "SmolLM2-135M-Instruct"          # the default model's served name
    prompts, params = ChatCompletionRequest.model_validate(body).to_shared()
    assert params.max_tokens == 64 and len(prompts) == 1


def test_the_readme_grpc_example_sends_a_request_the_gateway_accepts(monkeypatch, capsys):
    """The README's gRPC snippet, run against a stub that checks its request the way the
    gateway's Generate does (request_to_shared) and answers one finished message."""
    from gateway.grpc_api import request_to_shared
    from proto import pdserve_pb2 as pb
    from proto import pdserve_pb2_grpc as pb_grpc

    sent = []

    class Stub:
        def __init__(self, channel):
            pass

        def Generate(self, request, **_):
            sent.append(request_to_shared(request))
            yield pb.GenerateResponse(text="Hi!", finish_reason="stop",
                                      usage=pb.Usage(prompt_tokens=3, completion_tokens=2))

    monkeypatch.setattr(pb_grpc, "GenerationStub", Stub)
    code = next(body for lang, body in fences(README.read_text())
                if lang == "python" and "GenerationStub" in body)
    assert 'insecure_channel("127.0.0.1:50051")' in code
    exec(compile(code, "README.md", "exec"), {})
    (prompt, params), = sent
    assert prompt.messages == ({"role": "user", "content": "Hello!"},)
    assert params.max_tokens == 64
    assert "Hi!" in capsys.readouterr().out


def test_the_mutual_tls_command_the_launcher_test_runs_is_the_documented_one():
    text = (ROOT / "docs" / "operations.md").read_text()
    command = ("PDSERVE_API_KEY=sk-mine pdserve up --ssl-certfile server.pem --ssl-keyfile "
               "server.key --ssl-ca-certs ca.pem --ssl-client-certfile client.pem "
               "--ssl-client-keyfile client.key")
    lines = [line for lang, body in fences(text) if lang == "sh" for line in shell_lines(body)]
    assert command in [" ".join(line.split()) for line in lines]


def test_supported_models_table_is_the_registry():
    """docs/models.md is what `python -m engine.models` prints, and every registered family
    has an HF parity test (a family in the table is a family tested)."""
    from engine.models import families, table
    from tests.moe_models import FAMILIES as MOE
    from tests.test_attention_families import FAMILIES as BY_LAYER
    from tests.test_model_parity import FAMILIES as DENSE

    assert (ROOT / "docs" / "models.md").read_text() == table(), \
        "regenerate: python -m engine.models > docs/models.md"
    tested = set(MOE) | {spec["model_type"] for spec in [*DENSE.values(), *BY_LAYER.values()]}
    assert {f.name for f in families()} <= tested
