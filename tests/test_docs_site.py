"""The README and the documentation site (issue 32): a short README, every page in the mkdocs nav,
every option the docs name exists in that command's parser, and every option is documented."""

from __future__ import annotations

import argparse
import json
import re

import pytest
import yaml

from tests._docs import DOCS, page, pages, section
from tests.conftest import REPO
from tuner.cli import build_parser

#: Options of ``ctx-tuner`` itself, given before the command.
GLOBAL_OPTIONS = {"--log-level", "--version", "--help"}


def _commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _long_options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings if o.startswith("--")}


def _command_uses(text: str, commands: set[str]) -> list[tuple[str, str, set[str]]]:
    """Every place ``text`` shows a command with options: inline code spans and code-block lines
    holding ``ctx-tuner COMMAND …``, and spans that begin with ``COMMAND --…`` (prose such as
    ``check --revision``). Returns (command, the text read, its ``--options``); the options stop at a
    lone ``--`` (the ``vllm serve`` line ``check`` reads) and at a shell comment."""
    fences = re.compile(r"^```.*?^```$", flags=re.S | re.M)
    pieces = re.findall(r"`([^`]+)`", fences.sub("", text))
    pieces += [ln for block in fences.findall(text) for ln in block.splitlines() if "ctx-tuner " in ln]
    names = "|".join(sorted(map(re.escape, commands), key=len, reverse=True))
    found = []
    for piece in pieces:
        piece = re.sub(r"\s#\s.*", "", piece)  # a shell comment
        for m in re.finditer(rf"(?:^|[\s($])ctx-tuner(?:\s+--log-level[= ]\S+)?\s+({names})(?![\w:-])(.*)", piece,
                             flags=re.S):
            found.append((m.group(1), piece, m.group(2)))
        m = re.match(rf"({names})(\s+--?[a-z].*)", piece, flags=re.S)
        if m and "ctx-tuner" not in piece:
            found.append((m.group(1), piece, m.group(2)))
    uses = []
    for cmd, piece, rest in found:
        rest = re.split(r"(?:^|\s)--(?:\s|$)", rest, maxsplit=1)[0]  # the serve line after `--`
        uses.append((cmd, piece, set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", rest))))
    return uses


def test_readme_is_at_most_250_lines():
    assert len(page("README.md").splitlines()) <= 250


def test_docs_named_check_revision_which_the_cli_lacks():
    """The README documented ``check --revision`` (a revision is given in the serve line ``check``
    reads); every ``--option`` the README or a docs page shows with a command is that command's."""
    commands = _commands()
    options = {name: _long_options(p) | GLOBAL_OPTIONS for name, p in commands.items()}
    wrong, seen = [], 0
    for name in ["README.md", *pages()]:
        for cmd, piece, used in _command_uses(page(name), set(commands)):
            seen += 1
            wrong += [(name, cmd, o, piece[:80]) for o in sorted(used - options[cmd])]
    assert wrong == []
    assert seen > 50  # the scan does find the commands the pages show
    assert _command_uses("the drop's `revision` (or `check --revision`) picks", set(commands)) == [
        ("check", "check --revision", {"--revision"})]


def test_revision_in_the_checked_serve_line_is_the_drops_revision(tiny_config, capsys):
    """What the docs say instead of ``check --revision``: ``--revision`` in the ``vllm serve`` line."""
    from tuner.cli import main

    rc = main(["check", "--parser", "built-in", "--no-variants", "--json", "--device", "H100-80GB",
               "--engine-version", "0.19.0", "--", "vllm", "serve", str(tiny_config), "--revision", "v1",
               "--max-model-len", "1024"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["drop"]["revision"] == "v1" and doc["read"]["values"]["revision"] == "v1"
    assert "`--revision` in the `vllm serve` line `check` reads" in page("drops.md")


@pytest.mark.parametrize("command", sorted(_commands()))
def test_every_option_is_in_the_option_reference(command):
    """docs/commands.md "Option reference" names exactly the options of each command's parser."""
    text = section("commands.md", f"ctx-tuner {command}", level=3)
    first_cells = re.findall(r"^\| `([^`]*)` \|", text, flags=re.M)
    documented = {o for cell in first_cells for o in re.findall(r"--[a-z][a-z0-9-]*", cell)}
    assert documented == _long_options(_commands()[command]) - {"--help"}


def test_every_command_has_a_reference_section():
    text = section("commands.md", "Option reference")
    assert re.findall(r"^### ctx-tuner (\S+)$", text, flags=re.M) == list(_commands())


def _nav_files(nav) -> list[str]:
    out = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        out += _nav_files(value) if isinstance(value, list) else [value]
    return out


def test_every_page_is_in_the_mkdocs_nav():
    config = yaml.load((REPO / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)  # !! tags as text
    listed = _nav_files(config["nav"])
    assert len(listed) == len(set(listed))
    assert sorted(listed) == pages()
    assert config["theme"]["name"] == "material" and config["strict"] == "true"


def test_readme_links_resolve():
    """Every relative link of the README names a file of the checkout (the docs pages, mostly), and
    every page's relative links a page or file under docs/."""
    text = page("README.md")
    links = [t for t in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text) if "://" not in t]
    assert len(links) >= 12
    assert [t for t in links if not (REPO / t).exists()] == []
    for name in pages():
        for t in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page(name)):
            if "://" not in t:
                assert ((DOCS / name).parent / t).exists(), (name, t)


def test_readme_drop_is_the_example_file():
    drop = "configs/examples/llama-3.1-8b-rtx3090-v0.yaml"
    text = page("README.md")
    shown = re.search(rf"`{re.escape(drop)}`[^\n]*:\n\n```yaml\n(.*?)```\n", text, flags=re.S).group(1)
    lines = [ln for ln in (REPO / drop).read_text().splitlines(keepends=True) if not ln.startswith("#")]
    assert shown == "".join(lines)


def _samples(text: str) -> dict[str, str]:
    """``$ COMMAND`` -> the output block under it, for every sample in a page."""
    return {m.group(1): m.group(2) for m in re.finditer(r"^```\n\$ (ctx-tuner [^\n]*)\n(.*?)^```$", text, re.S | re.M)}


def test_sample_copies_in_the_docs_are_the_readmes():
    """A sample shown in the README and again in a docs page is the same text in both (the README's
    copies are compared with the real output by tests/test_fresh_user_findings.py)."""
    readme = _samples(page("README.md"))
    assert len(readme) == 3
    copies = 0
    for name in pages():
        for cmd, out in _samples(page(name)).items():
            if cmd in readme:
                copies += 1
                assert out == readme[cmd], (name, cmd)
    assert copies == 3  # profile (getting-started), check (check), explain (explain)


@pytest.mark.slow
def test_readme_check_sample_lacked_the_interval_line_and_had_a_stale_tp2_figure(tmp_path, monkeypatch, capsys):
    """The README's ``check`` sample had no ``interval:`` line and said ``--tensor-parallel-size 2
    (159360 KV tokens)`` where ``check`` prints 186880 (as ``explain`` does); it is now the command's
    real output, line for line, run as a fresh clone runs it: in a view of the checkout with no store
    (tests/conftest.py ``checkout_view``; the ``parser:`` line names the venv's Python), after the
    README's own ``profile`` sample created the store (a fresh user: the sample said "store: none"
    where the README's flow has one)."""
    from tests.conftest import as_in_the_docs, checkout_view
    from tuner.cli import main

    command = ("ctx-tuner check --device RTX-3090 --engine-version 0.6.4 -- vllm serve "
               "configs/models/meta-llama--Llama-3.1-8B-Instruct --max-model-len 29000 "
               "--gpu-memory-utilization 0.9 --port 8000")
    view = checkout_view(tmp_path / "ctx-tuner")
    monkeypatch.chdir(view)
    monkeypatch.setenv("CTX_TUNER_ENGINE", "off")
    monkeypatch.delenv("CTX_TUNER_WORKER_PYTHON", raising=False)
    assert main(["profile", "configs/examples/llama-3.1-8b-rtx3090-v0.yaml"]) == 0  # the README's first sample
    capsys.readouterr()
    assert main(command.split()[1:]) == 3
    out = as_in_the_docs(capsys.readouterr().out, view, REPO)
    sample = _samples(page("README.md"))[command].splitlines()
    assert sample[-2:] == ["$ echo $?", "3"]
    assert "store: /src/ctx-tuner/var/ctx-tuner.sqlite (its pass memo read; nothing written)" in out
    keep = [i for i, ln in enumerate(sample[:-2]) if not ln.startswith("parser: ")]
    assert [out[i] for i in keep] == [sample[i] for i in keep] and len(out) == len(sample) - 2
    assert "  --tensor-parallel-size 2 (186880 KV tokens):" in out


#: One API page per package (issue 32): the packages of the relayout.
API_PACKAGES = ("releases", "memory", "question", "logs", "model", "seam", "engine", "measure", "store", "jobs",
                "reports", "accuracy", "daemon", "deploy", "commands")


@pytest.mark.parametrize("package", API_PACKAGES)
def test_api_page_renders_every_module_of_its_package(package):
    """docs/api/PACKAGE.md renders the package's docstring and every module (or sub-package) in it, so
    a module added later is not left out of the API pages."""
    text = page(f"api/{package}.md")
    shown = re.findall(r"^::: (tuner\.[\w.]+)$", text, flags=re.M)
    d = REPO / "tuner" / package
    modules = {p.stem for p in d.glob("*.py") if p.stem != "__init__"}
    modules |= {p.name for p in d.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert shown[0] == f"tuner.{package}" and sorted(shown[1:]) == sorted(f"tuner.{package}.{m}" for m in modules)


def test_every_package_has_an_api_page():
    packages = {p.parent.name for p in (REPO / "tuner").glob("*/__init__.py")} - {"data", "simulate"}
    assert packages <= set(API_PACKAGES) and (DOCS / "api" / "index.md").is_file()
