"""Hostlists: table cases, properties, and the same properties checked against real scontrol."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from hpct_slurm.cli import main
from hpct_slurm.errors import HpctError
from hpct_slurm.slurm.hostlist import MAX_RANGE, compress, expand


@pytest.mark.parametrize("hostlist, hosts", [
    ("n1", ["n1"]),
    ("n[1-3]", ["n1", "n2", "n3"]),
    ("n[001-003]", ["n001", "n002", "n003"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    # padding comes from the low bound's text only
    ("n[01-3]", ["n01", "n02", "n03"]),
    ("n[1-03]", ["n1", "n2", "n3"]),
    ("n[1-3,5],m2", ["n1", "n2", "n3", "n5", "m2"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    # Slurm's product order: last group fastest, then first, ..., the one before last slowest
    ("a[1-2]b[3-4]c[5-6]", ["a1b3c5", "a1b3c6", "a2b3c5", "a2b3c6",
                            "a1b4c5", "a1b4c6", "a2b4c5", "a2b4c6"]),
    ("n1,n1,n2", ["n1", "n1", "n2"]),
    ("n[2,1,1]", ["n2", "n1", "n1"]),
    ("[1-2]", ["1", "2"]),
    ("n[1-2],,n3 m4\tk", ["n1", "n2", "n3", "m4", "k"]),
    ("n-[1-2]", ["n-1", "n-2"]),
    # text after the last group, as scontrol show hostnames gives it from 23.02 on (recorded
    # from 24.11.5: tests/data/slurm/24.11/show-hostnames-suffix.txt)
    ("n[1-2]-ib", ["n1-ib", "n2-ib"]),
    ("n[1-2]a", ["n1a", "n2a"]),
    ("n[1-2]-ib,m[3]x", ["n1-ib", "n2-ib", "m3x"]),
    ("a[1-2]b[3-4]c[5-6]-x", ["a1b3c5-x", "a1b3c6-x", "a2b3c5-x", "a2b3c6-x",
                              "a1b4c5-x", "a1b4c6-x", "a2b4c5-x", "a2b4c6-x"]),
    ("n[01-2]-ib[1-2]y", ["n01-ib1y", "n01-ib2y", "n02-ib1y", "n02-ib2y"]),
])
def test_expand_table(hostlist: str, hosts: list[str]) -> None:
    assert expand(hostlist) == hosts


@pytest.mark.parametrize("hostlist, why", [
    ("n[1-", "unclosed '['"),
    ("n[3-1]", "range '3-1' counts down"),
    ("n[a-b]", "range 'a-b' is not N or N-M"),
    ("n[]", "range '' is not N or N-M"),
    ("n[1-]", "range '1-' is not N or N-M"),
    ("n[-1]", "range '-1' is not N or N-M"),
    ("n1]", "']' without '['"),
    ("n[[1]]", "nested '['"),
    ("n[ 1-2]", "whitespace inside"),
    ("", "names no host"),
    (" , ", "names no host"),
    (f"n[0-{MAX_RANGE}]", f"more than {MAX_RANGE} hosts"),
])
def test_expand_rejects(hostlist: str, why: str) -> None:
    with pytest.raises(HpctError) as err:
        expand(hostlist)
    assert str(err.value).startswith(f"HPCT: hostlist {hostlist!r} is not a hostlist: ")
    assert why in str(err.value)


@pytest.mark.parametrize("hosts, text", [
    (["n1", "n2", "n3"], "n[1-3]"),
    (["n9", "n10", "n08", "n1", "n01", "x", "x", "n1"], "n[9-10,08,1,01],x,x,n1"),
    (["n001", "n002", "n003", "n005"], "n[001-003,005]"),
    (["a", "b1"], "a,b1"),
    (["12", "13", "14"], "[12-14]"),
    (["n1", "n2"], "n1,n2"),
    ([], ""),
])
def test_compress_table(hosts: list[str], text: str) -> None:
    assert compress(hosts) == text


@pytest.mark.parametrize("bad", ["a b", "n[1]", "x,y", ""])
def test_compress_rejects_unwritable_names(bad: str) -> None:
    with pytest.raises(HpctError, match="cannot be written in a hostlist"):
        compress(["n1", bad])


# ---- properties -------------------------------------------------------------------------

_prefix = st.text(alphabet="abcxyz-_.", min_size=0, max_size=4)


@st.composite
def host_names(draw) -> str:
    prefix = draw(_prefix)
    number = draw(st.none() | st.integers(0, 2000))
    if number is None:
        return prefix or "h"
    return prefix + str(number).zfill(draw(st.integers(0, 5)))


@st.composite
def ranges(draw) -> str:
    lo = draw(st.integers(0, 120))
    width = draw(st.integers(0, 4))
    if draw(st.booleans()):
        return str(lo).zfill(width)
    return f"{str(lo).zfill(width)}-{lo + draw(st.integers(0, 6))}"


@st.composite
def hostlists(draw, suffixes: bool = True) -> str:
    """Hostlists in the grammar Slurm and we both accept: up to 3 bracket groups a token, and
    (`suffixes`) text after the last one, which Slurm accepts from 23.02 on."""
    tokens = []
    for _ in range(draw(st.integers(1, 3))):
        groups = draw(st.integers(0, 3))
        if groups == 0:
            tokens.append(draw(host_names()))
            continue
        token = draw(_prefix)
        for g in range(groups):
            if g:
                token += draw(st.text(alphabet="abz-.", min_size=0, max_size=2))
            token += "[" + ",".join(draw(st.lists(ranges(), min_size=1, max_size=3))) + "]"
        if suffixes and draw(st.booleans()) and draw(st.booleans()):
            token += draw(st.text(alphabet="abz-.", min_size=1, max_size=3))
        tokens.append(token)
    return ",".join(tokens)


@given(st.lists(host_names(), min_size=1, max_size=25))
def test_compress_then_expand_is_identity(hosts: list[str]) -> None:
    assert expand(compress(hosts)) == hosts


@given(token=st.builds(lambda p, r: f"{p}[{','.join(r)}]", _prefix,
                       st.lists(ranges(), min_size=1, max_size=3)),
       suffix=st.text(alphabet="abz-._", min_size=1, max_size=4))
def test_text_after_the_bracket_ends_every_name(token: str, suffix: str) -> None:
    assert expand(token + suffix) == [host + suffix for host in expand(token)]


@given(hostlists())
def test_expand_compress_expand_is_stable(hostlist: str) -> None:
    hosts = expand(hostlist)
    assert expand(compress(hosts)) == hosts
    assert len(compress(hosts)) <= len(",".join(hosts))


# ---- the same, against real scontrol -----------------------------------------------------

# The cluster fixture heals once per test, not per example: the examples only read from it.
_SHARED_CLUSTER = [HealthCheck.function_scoped_fixture]


def _scontrol(cluster, *args: str) -> str:
    # "--": a generated hostlist may start with '-', which scontrol would take for an option
    proc = cluster.run(["scontrol", "--", "show", *args])
    assert proc.returncode == 0, proc.stderr
    # scontrol exits 0 on a bad hostlist; the text is the only sign
    assert "Invalid hostlist" not in proc.stderr + proc.stdout, (args, proc.stderr)
    return proc.stdout


@pytest.mark.cluster
@settings(max_examples=60, deadline=None, suppress_health_check=_SHARED_CLUSTER)
@given(data=st.data())
def test_expand_matches_scontrol_hostnames(cluster, data) -> None:
    # Slurm 22.05 refuses text after the last ']' ("Invalid hostlist"); 23.02 on expand it
    version = cluster.run(["scontrol", "--version"]).stdout
    hostlist = data.draw(hostlists(suffixes=not version.startswith("slurm-wlm 22.")))
    assert expand(hostlist) == _scontrol(cluster, "hostnames", hostlist).split()


@pytest.mark.cluster
@settings(max_examples=60, deadline=None, suppress_health_check=_SHARED_CLUSTER)
@given(hosts=st.lists(host_names(), min_size=1, max_size=25))
@example(hosts=["-"])
def test_compress_agrees_with_scontrol(cluster, hosts: list[str]) -> None:
    ours = compress(hosts)
    # Slurm reads our compressed text back as exactly the hosts ...
    assert _scontrol(cluster, "hostnames", ours).split() == hosts
    # ... and we read Slurm's own compressed text back as exactly the hosts. (26.05's
    # `scontrol show hostlist -` reads the list from stdin: a lone '-' is not asked)
    if hosts == ["-"]:
        return
    theirs = _scontrol(cluster, "hostlist", ",".join(hosts)).strip()
    assert expand(theirs) == hosts


@pytest.mark.cluster
@pytest.mark.parametrize("hostlist", ["n[3-1]", "n[a-b]", "n[]", "n[1-2]]"])
def test_slurm_rejects_what_we_reject(cluster, hostlist: str) -> None:
    proc = cluster.run(["scontrol", "show", "hostnames", hostlist])
    with pytest.raises(HpctError):
        expand(hostlist)
    version = cluster.run(["scontrol", "--version"]).stdout
    if hostlist == "n[1-2]]" and not version.startswith("slurm-wlm 22."):
        # from 23.02 on Slurm takes any text after the last ']' as a suffix, a ']' too
        # (measured on 24.11 and 26.05). A name with ']' in it could never be listed in a
        # hostlist again: hostlist.expand keeps refusing it.
        assert proc.stdout.split() == ["n1]", "n2]"], proc.stdout + proc.stderr
    else:
        assert "Invalid hostlist" in proc.stderr + proc.stdout


def test_cli_expand_and_compress(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["hostlist", "expand", "n[1-2]", "m[01-02]"]) == 0
    assert capsys.readouterr().out.split() == ["n1", "n2", "m01", "m02"]
    assert main(["hostlist", "compress", "n1", "n2", "n[3-4]"]) == 0
    assert capsys.readouterr().out.strip() == "n[1-4]"
    assert main(["hostlist", "expand", "n[1-"]) == 2
    assert "HPCT: hostlist 'n[1-' is not a hostlist: unclosed '['" in capsys.readouterr().err
