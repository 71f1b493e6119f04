"""Command-line arguments that used to crash: each is now a usage error (exit 2) naming the option,
or, for a closed stdout, a quiet exit."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys

import pytest

from tuner.cli import main
from tests._cli_helpers import run_cli as _cli

# every command that runs a worker, with the arguments it needs to reach --timeout
TIMEOUT_COMMANDS = {
    "profile": ["profile", "d.yaml"],
    "explain": ["explain", "d.yaml"],
    "plot": ["plot", "d.yaml", "-o", "x.png"],
    "import-log": ["import-log", "x.log", "--model", "m", "--device", "H100-80GB"],
    "validate": ["validate", "cases.jsonl"],
    "selftest": ["selftest", "--gpu"],
}




@pytest.mark.parametrize("command", sorted(TIMEOUT_COMMANDS))
@pytest.mark.parametrize("value", ["1e9", "inf", "nan", "-1", "0", "86401", "abc"])
def test_timeout_must_be_finite_and_at_most_a_day(command, value):
    rc, _, err = _cli(*TIMEOUT_COMMANDS[command], "--timeout", value)
    assert rc == 2 and "--timeout" in err and "Traceback" not in err, err


def test_timeout_of_a_day_is_accepted():
    from tuner.cli import build_parser

    for argv in TIMEOUT_COMMANDS.values():
        assert build_parser().parse_args([*argv, "--timeout", "86400"]).timeout == 86400.0


def test_log_level_is_a_choice_case_insensitive():
    rc, _, err = _cli("--log-level", "BOGUS", "results", "--db", "nowhere.sqlite")
    assert rc == 2 and "--log-level" in err and "DEBUG" in err
    from tuner.cli import build_parser

    assert build_parser().parse_args(["--log-level", "debug", "results"]).log_level == "DEBUG"


def test_validate_filter_must_be_a_regex(tmp_path):
    cases = tmp_path / "cases.jsonl"
    cases.write_text("")
    rc, _, err = _cli("validate", str(cases), "--filter", "(")
    assert rc == 2 and "--filter" in err and "'('" in err and "regular expression" in err


def test_plot_output_extension_must_be_a_matplotlib_format(tmp_path):
    pytest.importorskip("matplotlib")
    rc, _, err = _cli("plot", "--model", "x", "-o", str(tmp_path / "x.txt"))
    assert rc == 2 and "-o" in err and "x.txt" in err and "png" in err and "svg" in err
    assert not (tmp_path / "x.txt").exists()


def test_results_table_goes_with_csv(tmp_path):
    rc, _, err = _cli("results", "--db", str(tmp_path / "none.sqlite"), "--table", "runs")
    assert rc == 2 and "--table goes with --csv" in err


def test_closed_stdout_exits_quietly(tmp_path):
    """``ctx-tuner results --json | head``: the reader is gone before the write; exit 0, no traceback,
    no 'Exception ignored' at interpreter exit."""
    from tuner.store.database import open_store

    db = tmp_path / "r.sqlite"
    open_store(str(db)).close()
    r, w = os.pipe()
    os.close(r)  # a reader that already went away: every write gets EPIPE
    try:
        p = subprocess.run([sys.executable, "-m", "tuner.cli", "results", "--db", str(db), "--json"],
                           stdout=w, stderr=subprocess.PIPE, text=True, timeout=120, cwd=tmp_path)
    finally:
        os.close(w)
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""


@pytest.mark.parametrize("command", ["profile", "explain", "plot"])
def test_q_is_not_quiet_since_it_is_vllms_quantization(command):
    """``-q`` is vLLM's ``--quantization``; ctx-tuner keeps only ``--quiet`` so a pasted vLLM flag
    never silently means something else."""
    argv = {"profile": ["profile", "d.yaml"], "explain": ["explain", "d.yaml"], "plot": ["plot", "d.yaml", "-o", "x.png"]}
    rc, _, err = _cli(*argv[command], "-q")
    assert rc == 2 and "unrecognized arguments: -q" in err


def test_bare_ctx_tuner_printed_argparse_required_error_instead_of_help():
    """``ctx-tuner`` with no arguments printed only argparse's "the following arguments are
    required" line; it now prints the full help (every command with its one-line summary) on
    stdout and exits 2, as a usage error."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([])
    assert code == 2
    text = out.getvalue()
    assert text.startswith("usage: ctx-tuner")
    assert "required" not in text + err.getvalue()
    for command in ("profile", "check", "explain", "results", "plot", "daemon", "retry", "status", "validate",
                    "import-log", "devices", "selftest"):
        assert f"    {command} " in text or f"    {command}\n" in text, command


def test_cli_paid_interpreter_teardown_after_its_answer(tmp_path):
    """The console script (``tuner.cli:run``) ends the process once :func:`main` returned, its
    output flushed, without the interpreter's teardown (~0.1 s of a cold CLI): the exit code is
    main's, stdout is complete, atexit handlers do not run. In-process, ``exit_`` gets the code."""
    probe = ("import atexit, sys\n"
             "atexit.register(lambda: sys.stderr.write('ctx-teardown-ran'))\n"
             "from tuner.cli import run\n"
             "run([])\n")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stdout.startswith("usage: ctx-tuner") and "    profile " in proc.stdout
    assert "ctx-teardown-ran" not in proc.stderr
    from tuner.cli import run

    codes = []
    with contextlib.redirect_stdout(io.StringIO()):
        run([], exit_=codes.append)
    assert codes == [2]


def test_output_to_a_full_disk_gave_a_traceback(monkeypatch):
    """``ctx-tuner profile … > /dev/full`` ended in an ``OSError [Errno 28]`` traceback; an output
    that cannot be written is one line on stderr and exit 1 now. Other OSErrors still propagate."""
    import errno

    import tuner.commands.devices as devices_cmd

    def full(_args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(devices_cmd, "run", full)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert main(["devices"]) == 1
    assert err.getvalue() == "ctx-tuner: cannot write the output: No space left on device\n"

    def missing(_args):
        raise OSError(errno.ENOENT, "No such file or directory")

    monkeypatch.setattr(devices_cmd, "run", missing)
    with pytest.raises(FileNotFoundError):
        main(["devices"])


def test_closed_stderr_made_profile_fail_silently():
    """``ctx-tuner profile DROP 2>&-`` exited 1 with no output and stored nothing
    (``sys.stderr.isatty()`` on None in the progress printer); with stdout closed (``>&-``) the
    final flush raised AttributeError. Both now run the command: the progress sink is off, the
    result is stored."""
    from tuner.commands.explain import progress_printer

    class Args:
        progress = None
        quiet = False

    probe = ("import sys\n"
             "sys.stderr = None\n"
             "from tuner.commands.explain import progress_printer\n"
             "class A: progress = True; quiet = False\n"
             "print(progress_printer(A()) is None)\n")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "True", proc.stderr
    assert progress_printer(Args()) is None  # pytest's stderr is no tty
    closed = subprocess.run([sys.executable, "-c", "import sys; sys.stdout = None\n"
                             "from tuner.cli import main\nprint(main(['devices', '--json']), file=sys.stderr)"],
                            capture_output=True, text=True, timeout=120)
    assert "AttributeError" not in closed.stderr and closed.stderr.strip().splitlines()[-1] == "1"
