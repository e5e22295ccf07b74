import subprocess
import sys

from kvtier.cli import SUBCOMMAND_MODULES, build_parser


def test_help_lists_only_registered_working_subcommands():
    out = subprocess.run([sys.executable, "-m", "kvtier.cli", "--help"], capture_output=True,
                         text=True, check=True).stdout
    assert "stack" in out
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, p in sub.choices.items():
        # Every registered subcommand resolves to a callable.
        assert p.get_default("func") is not None or any(
            getattr(a, "choices", None) for a in p._actions), name


def test_no_args_prints_help_and_fails():
    r = subprocess.run([sys.executable, "-m", "kvtier.cli"], capture_output=True, text=True)
    assert r.returncode == 2 and "usage" in r.stdout


def test_missing_modules_are_skipped_not_fatal(monkeypatch):
    import kvtier.cli as cli

    monkeypatch.setattr(cli, "SUBCOMMAND_MODULES", (*SUBCOMMAND_MODULES, "kvtier.no_such_module"))
    cli.build_parser()  # does not raise


def test_stack_up_rejects_unknown_model():
    r = subprocess.run([sys.executable, "-m", "kvtier.cli", "stack", "up", "--model", "/no/such"],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "neither a preset" in r.stderr
