"""One parser for every number in the settings table and on the controller's command line:
ASCII digits only, finite, inside the table's bounds, one error line naming the variable or
the flag. And one default for each controller flag that mirrors a setting: the table's."""
from __future__ import annotations

import argparse
import inspect
import re
import socket
import threading
from datetime import timedelta
from pathlib import Path

import pytest

from hpct_slurm import config as C
from hpct_slurm.cli import build_parser, main
from hpct_slurm.controller import cli as ctl_cli

NUMBERS = [s for s in C.SETTINGS if s.kind in ("int", "seconds", "fraction")]
# what float() or int() take and the docs refuse: other scripts' digits, separators, words
HOSTILE = ["١٢", "１２", "1_000", "inf", "-inf", "nan", "1e309", "1e3", "+1", "0x10", "1 2"]


def _controller_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["controller"]


def _controller_options(monkeypatch, argv: list[str]):
    """The Options that `hpct-slurm controller ARGV -- true` would run a controller with, in a
    job of six nodes (the controller itself is not started)."""
    from hpct_slurm.controller import controller as ctl
    seen = []

    class Caught(Exception):
        pass

    def capture(opts):
        seen.append(opts)
        raise Caught

    monkeypatch.setattr(ctl, "Controller", capture)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-6]")
    monkeypatch.setenv("SLURMD_NODENAME", "n1")
    args = _controller_parser().parse_args([*argv, "--", "true"])
    with pytest.raises(Caught):
        args.func(args)
    return seen[0]


def _refused(argv: list[str], capsys) -> str:
    """The one error line argparse prints for `hpct-slurm ARGV` (exit 2)."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


# ---- the settings table --------------------------------------------------------------------
@pytest.mark.parametrize("setting", NUMBERS, ids=lambda s: s.name)
def test_a_number_setting_takes_ascii_digits_only_and_finite_values(setting):
    for bad in HOSTILE:
        with pytest.raises(C.SettingError) as err:
            C.read({setting.name: bad}, setting.name)
        assert err.value.message.startswith(f"{setting.name} "), err.value.message
        assert "\n" not in err.value.message


@pytest.mark.parametrize("setting", NUMBERS, ids=lambda s: s.name)
def test_every_number_default_passes_its_own_parser(setting):
    if setting.default is None:
        return
    text = f"{setting.default:g}" if isinstance(setting.default, float) else \
        str(setting.default)
    assert C.read({setting.name: text}, setting.name) == setting.default


def test_an_infinite_collective_timeout_is_refused_not_overflowed_later():
    with pytest.raises(C.SettingError, match=r"HPCT_COLLECTIVE_TIMEOUT_S 'inf' is not a "
                                             r"positive number of seconds"):
        C.read({C.COLLECTIVE_TIMEOUT_S: "inf"}, C.COLLECTIVE_TIMEOUT_S)
    with pytest.raises(C.SettingError, match=r"HPCT_INIT_TIMEOUT_S=99999999 is out of range: "
                                             r"it must be at most 604800 seconds"):
        C.read({C.INIT_TIMEOUT_S: "99999999"}, C.INIT_TIMEOUT_S)


@pytest.mark.parametrize("setting", [s for s in NUMBERS if s.kind == "seconds"],
                         ids=lambda s: s.name)
def test_the_longest_seconds_value_fits_every_timeout_it_feeds(setting):
    longest = C.read({setting.name: str(setting.seconds_max())}, setting.name)
    timedelta(seconds=longest)  # torch's process-group timeouts
    assert longest <= threading.TIMEOUT_MAX
    with socket.socket() as sock:
        sock.settimeout(longest)
    assert C.read({setting.name: "0.25"}, setting.name) == 0.25
    assert C.read({setting.name: ".5"}, setting.name) == 0.5


def test_seconds_and_fractions_the_controller_writes_read_back():
    """What the controller hands its ranks (str(float), pacing's :g) is what the stricter
    parser takes, at every scale."""
    from hpct_slurm.controller.options import Options
    from hpct_slurm.controller.pacing import pace

    fields = Options.__dataclass_fields__
    for name, field in ((C.COLLECTIVE_TIMEOUT_S, "collective_timeout_s"),
                        (C.INIT_TIMEOUT_S, "init_timeout_s")):
        value = fields[field].default
        assert C.read({name: str(value)}, name) == value
    for ranks in (1, 1000, 2000, 16384, 100_000):
        for name, text in pace(ranks, 3.0).env().items():
            assert C.read({name: text}, name) == float(text)
    assert C.read({C.SHM_FRACTION: "0.25"}, C.SHM_FRACTION) == 0.25
    with pytest.raises(C.SettingError, match=r"HPCT_SHM_FRACTION '１' is not a number in"):
        C.read({C.SHM_FRACTION: "１"}, C.SHM_FRACTION)


# ---- the controller's flags -----------------------------------------------------------------
@pytest.mark.parametrize("flag, value, says", [
    ("--heartbeat-timeout", "nan", "'nan' is not a positive number of seconds"),
    ("--heartbeat-timeout", "-1", "'-1' is not a positive number of seconds"),
    ("--heartbeat-timeout", "inf", "'inf' is not a positive number of seconds"),
    ("--progress-timeout", "1e309", "'1e309' is not a positive number of seconds"),
    ("--progress-timeout", "0", "'0' is not a positive number of seconds"),
    ("--persist-every", "-5", "-5 is out of range: it must be at least 0"),
    ("--pool-spares", "-2", "-2 is out of range: it must be at least 0"),
    ("--tasks-per-node", "0", "0 is out of range: it must be at least 1"),
    ("--spares", "١", "'١' is not a non-negative integer"),
    ("--spares", "-1", "-1 is out of range: it must be at least 0"),
    ("--want-spares", "1_000", "'1_000' is not a non-negative integer"),
    ("--active", "１２", "'１２' is not a positive integer"),
    ("--active", "0", "0 is out of range: it must be at least 1"),
])
def test_controller_flags_are_checked_by_the_table(flag, value, says, capsys):
    line = _refused(["controller", flag, value, "--", "true"], capsys)
    assert line == f"hpct-slurm controller: error: argument {flag}: {says}"


def test_move_takes_a_slurm_job_id_only(capsys):
    line = _refused(["move", "n1", "١٢"], capsys)
    assert line.startswith("hpct-slurm move: error: argument JOBID: job id '١٢' is not a "
                           "Slurm job id")


def test_every_number_flag_of_the_controller_parses_by_a_table_entry():
    """No bare int/float: a number flag takes its type from config (a setting's entry or, for
    a flag with no setting, config.number_type), and a flag that mirrors a setting uses that
    very entry."""
    for action in _controller_parser()._actions:
        if action.type is None:
            continue
        setting = getattr(action.type, "setting", None)
        assert setting is not None, f"{action.option_strings} parses with {action.type}"
        flag = action.option_strings[-1]
        if setting.name:
            assert C.BY_NAME[ctl_cli.MIRRORS[flag]] is setting, flag


def _options(**kw):
    from hpct_slurm.controller.options import Options

    return Options(command=["true"], run_dir=Path("/nonexistent"), job_id=7, nodes=["n1"],
                   batch_host="n1", **kw)


@pytest.mark.parametrize("field, value, says", [
    ("heartbeat_timeout_s", float("nan"), "Options.heartbeat_timeout_s 'nan' is not a "
                                          "positive number of seconds"),
    ("heartbeat_timeout_s", -1, "Options.heartbeat_timeout_s '-1' is not a positive number "
                                "of seconds"),
    ("progress_timeout_s", float("inf"), "Options.progress_timeout_s=inf is out of range: "
                                         "it must be at most 604800 seconds"),
    ("ready_timeout_s", 0.0, "Options.ready_timeout_s '0.0' is not a positive number of "
                             "seconds"),
    ("tasks_per_node", 0, "Options.tasks_per_node=0 is out of range: it must be at least 1"),
    ("spares", -1, "Options.spares=-1 is out of range: it must be at least 0"),
    ("persist_every", 2.5, "Options.persist_every '2.5' is not an integer"),
    ("active", True, "Options.active 'True' is not an integer"),
    ("slurmd_port", 70000, "Options.slurmd_port=70000 is out of range: it must be in 1-65535"),
    ("on_no_spare", "retry", "Options.on_no_spare 'retry' is not one of requeue, shrink, "
                             "fail"),
])
def test_options_given_from_python_are_checked_by_the_flags_rules(field, value, says):
    """Issue 45, item 5: the CLI refused NaN, -1 and --tasks-per-node 0, Options made from
    Python took them (a NaN timeout never fires). Now Options checks every field, by the rule
    its flag parses with."""
    with pytest.raises(C.SettingError) as exc:
        _options(**{field: value})
    assert str(exc.value) == f"HPCT: {says}"


def test_options_and_the_controllers_flags_share_one_rule_per_field():
    from hpct_slurm.controller.options import RULES

    dests = {a.option_strings[-1]: a for a in _controller_parser()._actions if a.option_strings}
    for flag, name in ctl_cli.MIRRORS.items():
        field = dests[flag].dest + ("_s" if flag.endswith("-timeout") else "")
        assert RULES[field] is C.BY_NAME[name], flag
    assert dests["--heartbeat-timeout"].type.setting is RULES["heartbeat_timeout_s"]
    _options()  # the defaults pass


def test_every_controller_flag_that_mirrors_a_setting_has_the_tables_default():
    parser = _controller_parser()
    args = parser.parse_args([])
    flags = {a.option_strings[-1]: a for a in parser._actions if a.option_strings}
    for flag, name in ctl_cli.MIRRORS.items():
        setting, action = C.BY_NAME[name], flags[flag]
        got = getattr(args, action.dest)
        if flag in ctl_cli.FROM_ENVIRON:
            assert got is None, flag  # then the variable, then the table (below)
        elif flag in ctl_cli.OWN_DEFAULT:
            assert got == ctl_cli.OWN_DEFAULT[flag][0], flag
        else:
            assert got == setting.default, flag
            assert f"default {C._default_text(setting)})" in action.help, flag
        if setting.kind == "choice":
            assert list(action.choices) == list(setting.choices), flag
    assert ctl_cli.defaults_from_spank(None, None, {}) == (C.BY_NAME[C.SPARES].default,
                                                           C.BY_NAME[C.STORE].default)
    # every flag is either a setting's or says why it is not one
    unmirrored = {"--help", "--run-dir", "--heartbeat-timeout"}
    assert set(flags) - set(ctl_cli.MIRRORS) == unmirrored
    # every setting whose text names a controller flag is mirrored by that flag
    for s in C.SETTINGS:
        for flag in re.findall(r"controller (--[a-z-]+)", s.doc):
            assert ctl_cli.MIRRORS.get(flag) == s.name, (s.name, flag)


# ---- disk persistence: one default ---------------------------------------------------------
def test_disk_persistence_has_one_default_and_it_is_on():
    """The templates ask for --requeue and promise that a requeued job (no spare left, the
    batch host lost, the time limit) resumes from the persisted snapshot: persistence is on
    unless a user turns it off, and the table, the controller's flag, its Options and
    main_from_env (which leaves what it is not given to Options) say the same number."""
    from hpct_slurm.controller.controller import main_from_env
    from hpct_slurm.controller.options import Options
    from hpct_slurm.templates import __file__ as templates_init

    default = C.BY_NAME[C.PERSIST_EVERY].default
    assert default > 0
    # the flag's own default is None: `controller.cli.run` reads the variable (exported
    # before sbatch; the templates pass no flag), then the table
    assert _controller_parser().parse_args([]).persist_every is None
    assert C.read({}, C.PERSIST_EVERY) == default
    assert C.read({C.PERSIST_EVERY: "0"}, C.PERSIST_EVERY) == 0
    assert Options.__dataclass_fields__["persist_every"].default == default
    assert "persist_every" not in inspect.signature(main_from_env).parameters
    for template in ("train.sbatch", "pool.sbatch"):
        text = (Path(templates_init).parent / template).read_text()
        assert "--persist-every" not in text  # the controller's default, the table's
        if template == "train.sbatch":
            assert "#SBATCH --requeue" in text and "persisted snapshot" in text


def test_the_timeouts_a_controller_is_given_reach_its_ranks_and_the_variables_do_not(
        monkeypatch):
    """`controller --init-timeout/--collective-timeout` set what every step the controller
    launches runs with (the ranks read HPCT_INIT_TIMEOUT_S / HPCT_COLLECTIVE_TIMEOUT_S from it);
    the variables in the controller's own environment are not read: the SPANK plugin exports a
    plain srun step's values (120 / 600) into every job."""
    monkeypatch.setenv(C.INIT_TIMEOUT_S, "600")  # what the SPANK plugin exports
    monkeypatch.setenv(C.COLLECTIVE_TIMEOUT_S, "120")
    opts = _controller_options(monkeypatch, ["--init-timeout", "12.5", "--collective-timeout",
                                             "4"])
    assert (opts.init_timeout_s, opts.collective_timeout_s) == (12.5, 4.0)
    opts = _controller_options(monkeypatch, [])
    assert (opts.init_timeout_s, opts.collective_timeout_s) == (
        C.BY_NAME[C.INIT_TIMEOUT_S].default, C.BY_NAME[C.COLLECTIVE_TIMEOUT_S].default)
    with pytest.raises(SystemExit):
        _controller_parser().parse_args(["--init-timeout", "nan", "--", "true"])


def test_every_controller_flag_reaches_its_options_field(monkeypatch):
    """cli.run hands main_from_env each flag by its Options field's name: a value given on the
    command line is the value the controller runs with, for every flag."""
    given = {"--spares": ("2", "spares", 2), "--active": ("3", "active", 3),
             "--persist-every": ("7", "persist_every", 7),
             "--pool-spares": ("1", "pool_spares", 1),
             "--pool-reservation": ("other", "pool_reservation", "other"),
             "--tasks-per-node": ("2", "tasks_per_node", 2),
             "--store": ("tcpstore", "store", "tcpstore"),
             "--heartbeat-timeout": ("4.5", "heartbeat_timeout_s", 4.5),
             "--progress-timeout": ("90", "progress_timeout_s", 90.0),
             "--on-no-spare": ("fail", "on_no_spare", "fail"),
             "--want-spares": ("2", "want_spares", 2),
             "--on-few-spares": ("refuse", "on_few_spares", "refuse"),
             "--collective-timeout": ("4", "collective_timeout_s", 4.0),
             "--init-timeout": ("12.5", "init_timeout_s", 12.5)}
    flags = {a.option_strings[-1] for a in _controller_parser()._actions if a.option_strings}
    assert flags - set(given) == {"--help", "--run-dir"}
    argv = [x for flag, (text, _, _) in given.items() for x in (flag, text)]
    opts = _controller_options(monkeypatch, argv + ["--run-dir", "/nonexistent/rd"])
    for flag, (_, field, value) in given.items():
        assert getattr(opts, field) == value, flag
    assert str(opts.run_dir) == "/nonexistent/rd"
