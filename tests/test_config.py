"""The settings table (hpct_slurm/config.py): every HPCT_* name the sources and docs use is in
it, only config.py reads one from an environment, the precedence rule holds, a bad value is
one SettingError naming the variable, and docs/admin.md's table is the generated one."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from hpct_slurm import config as C
from hpct_slurm.errors import HpctError

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "hpct_slurm"
NAME_RE = re.compile(r"(?<![A-Za-z0-9_])(?:SPANK_)?HPCT_[A-Z0-9_]*[A-Z0-9]")


def _sources() -> list[Path]:
    files = [p for p in PKG.rglob("*") if p.suffix in (".py", ".sh", ".sbatch")]
    files += list((ROOT / "spank").glob("*.[ch]")) + list((ROOT / "sbatch").glob("*"))
    files += list((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
    return [p for p in files if p.is_file()]


def test_every_hpct_name_in_sources_and_docs_is_in_the_table():
    known = set(C.BY_NAME) | set(C.RENAMED) | C.NOT_SETTINGS
    unknown = {}
    for path in _sources():
        for name in NAME_RE.findall(path.read_text(errors="replace")):
            if name not in known:
                unknown.setdefault(name, str(path.relative_to(ROOT)))
    assert not unknown, f"HPCT_* names missing from hpct_slurm/config.py SETTINGS: {unknown}"


def test_the_table_is_well_formed():
    assert len(C.BY_NAME) == len(C.SETTINGS)  # one entry per name
    for s in C.SETTINGS:
        assert s.set_by and set(s.set_by) <= set(C.SET_BY), s.name
        assert s.read_by and s.doc, s.name
        assert s.kind in C._PARSERS, s.name
        if s.kind in ("choice", "flag"):
            assert s.choices, s.name
        if s.default is not None and s.kind in ("int", "choice"):
            assert C.read({s.name: str(s.default)}, s.name) == s.default, s.name
    for old, new in C.RENAMED.items():
        assert new in C.BY_NAME and old not in C.BY_NAME


def test_defaults_agree_with_the_code_that_uses_them():
    from hpct_slurm.controller.controller import Options
    from hpct_slurm.hooks.context import HookConfig
    from hpct_slurm.rendezvous import derive

    assert C.BY_NAME[C.PORT_BASE].default == derive.DEFAULT_PORT_BASE
    assert C.BY_NAME[C.PORT_SPAN].default == derive.DEFAULT_PORT_SPAN
    assert C.BY_NAME[C.PORT_SPAN].lo == derive.GENERATION_WINDOW
    from hpct_slurm.controller.options import RULES

    fields = Options.__dataclass_fields__
    assert C.BY_NAME[C.COLLECTIVE_TIMEOUT_S].default == fields["collective_timeout_s"].default
    assert C.BY_NAME[C.INIT_TIMEOUT_S].default == fields["init_timeout_s"].default
    # every Options field that a setting rules has that setting's default; None in Options
    # means "the allocation decides" (cli.run fills it in), where the table names a number.
    # HPCT_TASKS_PER_NODE unset means the step's own; the controller's flag is 1 (above).
    mirrored = {name: rule for name, rule in RULES.items() if rule.name in C.BY_NAME}
    assert len(mirrored) >= 12
    for name, rule in mirrored.items():
        if name == "tasks_per_node":
            assert (fields[name].default, rule.default) == (1, None)
        elif name in ("active", "want_spares"):
            assert fields[name].default in (None, rule.default), name
        else:
            assert fields[name].default == rule.default, name
    hooks = HookConfig.__dataclass_fields__
    assert C.BY_NAME[C.SHM_FRACTION].default == hooks["shm_fraction"].default
    assert C.BY_NAME[C.DEFAULT_CACHE_MB].default == hooks["default_cache_mb"].default
    # the template's shell defaults are the table's (HPCT_TASKS_PER_NODE unset means the
    # step's own to the rendezvous; the template fills in 1 for the controller flag)
    text = (PKG / "templates" / "train.sbatch").read_text()
    found = re.findall(r"(HPCT_[A-Z_]+)=\$\{\1:-([^}]*)\}", text)
    assert len(found) >= 7
    for name, default in found:
        if name != C.TASKS_PER_NODE:
            assert str(C.BY_NAME[name].default) == default, name


# ---- only config.py reads HPCT_* ----------------------------------------------------------
_READERS = {"get", "getenv", "pop", "setdefault"}


def _hpct_names(tree: ast.Module) -> set[str]:
    """Module-level names bound to an HPCT_* string or to a config name (`X_ENV = C.STORE`)."""
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and \
                isinstance(node.targets[0], ast.Name) and _is_hpct(node.value, set()):
            names.add(node.targets[0].id)
    return names


def _is_hpct(node: ast.AST, aliases: set[str]) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return bool(NAME_RE.fullmatch(node.value))
    if isinstance(node, ast.Attribute):  # C.STORE, config.STORE
        return node.attr in vars(C) and isinstance(vars(C)[node.attr], str) and \
            vars(C)[node.attr] in C.BY_NAME
    return isinstance(node, ast.Name) and node.id in aliases


def _reads(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    aliases = _hpct_names(tree)
    found = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in _READERS:
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and not (
                isinstance(node.value, ast.Attribute) and node.value.attr == "BY_NAME"):
            key = node.slice  # (config.BY_NAME[...] is the table, not the environment)
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn))
                                                   for op in node.ops):
            key = node.left
        if key is not None and _is_hpct(key, aliases):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_only_the_settings_module_reads_hpct_variables():
    reads = [r for p in PKG.rglob("*.py") if p != PKG / "config.py" for r in _reads(p)]
    assert not reads, f"HPCT_* read outside hpct_slurm/config.py: {reads}"


def test_the_read_check_sees_a_read():
    """The AST check itself: each form of a read it must catch."""
    src = ("import os\nfrom hpct_slurm import config as C\nX_ENV = 'HPCT_STORE'\n"
           "a = os.environ.get('HPCT_RUN_DIR')\nb = os.getenv(X_ENV)\nc = env[C.STORE]\n"
           "d = 'HPCT_ROLE' in env\nenv[C.STORE] = 'x'\n")
    path = ROOT / "tests" / "_read_check_probe.py"
    path.write_text(src)
    try:
        assert [r.rsplit(":", 1)[1] for r in _reads(path)] == ["4", "5", "6", "7"]
    finally:
        path.unlink()


# ---- the precedence rule -----------------------------------------------------------------
def test_precedence_argument_then_environment_then_table_default():
    from hpct_slurm.controller.cli import defaults_from_spank

    env = {C.SPARES: "3", C.STORE: "tcpstore"}
    assert defaults_from_spank(0, "rootless", env) == (0, "rootless")  # the argument wins
    assert defaults_from_spank(None, None, env) == (3, "tcpstore")    # the sbatch option
    assert defaults_from_spank(None, None, {}) == (C.BY_NAME[C.SPARES].default,
                                                   C.BY_NAME[C.STORE].default)
    # the one name beats the old one; the old one is read only where the new one is unset
    assert C.read({C.STORE: "rootless", "HPCT_RENDEZVOUS": "tcpstore"}, C.STORE) == "rootless"
    assert C.read({"HPCT_RENDEZVOUS": "tcpstore"}, C.STORE) == "tcpstore"
    # an explicit default in the call stands in for the table's, a set value still wins
    assert C.read({}, C.PROGRESS_TIMEOUT_S, 5.0) == 5.0
    assert C.read({C.PROGRESS_TIMEOUT_S: "7"}, C.PROGRESS_TIMEOUT_S, 5.0) == 7.0


def test_the_controller_alone_hands_rank_settings_to_ranks():
    from hpct_slurm.hooks.task_prolog import CONTROLLER_OWNED, for_task

    for name in CONTROLLER_OWNED:
        assert C.BY_NAME[name].set_by == (C.CONTROLLER,), name
    derived = {C.COLLECTIVE_TIMEOUT_S: "120", C.INIT_TIMEOUT_S: "600", "MASTER_ADDR": "n1"}
    assert for_task(dict(derived), {C.CONTROLLER_ADDR: "10.0.0.1:1"}) == {"MASTER_ADDR": "n1"}
    assert for_task(dict(derived), {}) == derived  # plain srun: nobody else sets them


# ---- one error --------------------------------------------------------------------------
@pytest.mark.parametrize("setting", [s for s in C.SETTINGS
                                     if s.kind not in ("str", "path") and not s.shell_only],
                         ids=lambda s: s.name)
def test_a_bad_value_is_one_error_naming_variable_value_and_what_is_allowed(setting):
    with pytest.raises(C.SettingError) as err:
        C.read({setting.name: "x!"}, setting.name)
    assert isinstance(err.value, HpctError)
    message = err.value.message
    assert message.startswith(f"{setting.name} 'x!' is not "), message


def test_out_of_range_names_the_range_and_unknown_names_are_refused():
    with pytest.raises(C.SettingError, match=r"HPCT_PORT_BASE=70000 is out of range: it must "
                                             r"be in 1024-65535"):
        C.read({C.PORT_BASE: "70000"}, C.PORT_BASE)
    with pytest.raises(C.SettingError, match="HPCT_WORLD_SIZE=0 is out of range: it must be "
                                             "at least 1"):
        C.read({C.WORLD_SIZE: "0"}, C.WORLD_SIZE)
    with pytest.raises(KeyError):
        C.read({}, "HPCT_NO_SUCH_THING")
    assert C.read({C.PORT_BASE: ""}, C.PORT_BASE) == 20000  # empty is unset


def test_settings_for_a_scope_parses_the_whole_group():
    got = C.settings_for("hooks", {C.SHM_FRACTION: "0.25"})
    assert got[C.SHM_FRACTION] == 0.25 and got[C.DEFAULT_CACHE_MB] == 1024
    with pytest.raises(C.SettingError, match="HPCT_HEALTH_MIN_SHM_MB"):
        C.settings_for("hooks", {C.HEALTH_MIN_SHM_MB: "-1"})


# ---- docs/admin.md and `hpct-slurm settings` -----------------------------------------------
def test_admin_docs_table_is_the_generated_one(capsys):
    from hpct_slurm.cli import main

    text = (ROOT / "docs" / "admin.md").read_text()
    m = re.search(r"<!-- settings-table:begin[^\n]*-->\n(.*?)<!-- settings-table:end -->",
                  text, re.S)
    assert m, "docs/admin.md lacks the settings-table markers"
    assert m.group(1) == C.markdown_table(), \
        "docs/admin.md's settings table is stale: paste `hpct-slurm settings --markdown`"
    assert main(["settings", "--markdown"]) == 0
    assert capsys.readouterr().out == C.markdown_table()
    assert main(["settings", "--json"]) == 0
    import json
    records = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in records] == [s.name for s in C.SETTINGS]
