"""tests/trainer/support.py: no trainer a test started outlives it; a trainer forked from the worker's
zygote is a process as a fresh one would be."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainer import support
from tests.trainer.support import (MAX_ZYGOTES, REPO, ForkedProc, Proc, open_gate_on_notice, power_off_leftovers,
                                   run_args, run_trainer, start, trainer_env, worker_zygote, write_config)


def test_a_process_left_running_is_powered_off_and_a_finished_one_left_alone() -> None:
    done = Proc([sys.executable, "-c", "print('done')"])
    assert done.wait() == 0
    left = Proc([sys.executable, "-c", "import time; print('parked', flush=True); time.sleep(600)"], new_session=True)
    left.wait_for("parked")
    assert power_off_leftovers() == [left.p.pid]
    assert left.wait() == -signal.SIGKILL
    assert power_off_leftovers() == []


def test_a_process_that_does_not_end_in_time_fails_with_its_last_output() -> None:
    """A hang says what the process was doing (its output's end), not only its pid."""
    p = Proc([sys.executable, "-c", "import time; print('parked at step 16', flush=True); time.sleep(600)"],
             new_session=True)
    p.wait_for("parked")
    with pytest.raises(AssertionError, match="still running after 0.2 s; its output ends:\nparked at step 16$"):
        p.wait(timeout=0.2)
    assert power_off_leftovers() == [p.p.pid]


def test_a_plain_trainer_launch_is_forked_from_the_zygote_and_behaves_as_a_process(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    p = start(tmp_path / "run", 100000, config)
    assert isinstance(p, ForkedProc) and p.p.pid != worker_zygote().p.pid
    p.wait_for(r"event=step step=2/")
    assert Path(f"/proc/{p.p.pid}/cwd").resolve() == REPO
    assert os.getpgid(p.p.pid) == os.getpgrp()  # no session of its own unless asked, as Popen
    assert power_off_leftovers() == [p.p.pid]
    assert p.wait() == -signal.SIGKILL

    # Its own session when asked: a signal to the group reaches it; its exit status is the trainer's.
    p = Proc(run_args(tmp_path / "run", 100000, config), new_session=True)
    p.wait_for(r"event=step step=\d+/")
    assert os.getpgid(p.p.pid) == p.p.pid
    p.signal(signal.SIGTERM, group=True)
    assert p.wait() == 75, p.output[-3000:]

    # stdout and stderr apart, the environment the launch gave (not this process's), a usage error's 2.
    (tmp_path / "none").mkdir()
    out = run_trainer(["export", "--run-dir", str(tmp_path / "none"), "--out", str(tmp_path / "m.safetensors")])
    assert out.returncode == 2 and out.stdout == "", out
    assert out.stderr.strip().splitlines()[-1] == f"export: no valid checkpoint at {tmp_path / 'none'}"
    bad_key = trainer_env(SPOTTRAIN_CHECKPOINT_KEY_FILE=str(tmp_path / "missing.key"))
    s = run_trainer(["status", "--run-dir", str(tmp_path / "run"), "--json"], env=bad_key)
    assert s.returncode != 0 and "missing.key" in s.stderr, s


def _keep_only(default: support.Zygote) -> None:
    """Close the worker's zygotes but ``default`` (none of their children is running between tests)."""
    for key, zygote in list(support._worker_zygotes.items()):
        if zygote is not default:
            zygote.close()
            del support._worker_zygotes[key]


def test_a_launch_the_zygote_cannot_reproduce_gets_a_fresh_interpreter(tmp_path: Path) -> None:
    argv = run_args(tmp_path / "run", 2, write_config(tmp_path))
    p = Proc(argv, fork=False)
    assert type(p) is Proc and p.wait() == 0, p.output[-3000:]
    # PYTHONHASHSEED is read when the interpreter starts: a fork keeps its zygote's, so the launch
    # is forked from a zygote started with it (the worker's default one is left as it was). The
    # worker's earlier tests may have started others (a torchrun launch's TORCH_* settings, a job's
    # own path first): closed first, so that this test starts from the default alone.
    default = worker_zygote()
    _keep_only(default)
    p = Proc([*argv, "--extend-steps"], env=trainer_env(PYTHONHASHSEED="7"))
    assert isinstance(p, ForkedProc) and p.wait() == 0, p.output[-3000:]
    assert p.zygote is not default and p.zygote.env["PYTHONHASHSEED"] == "7"
    assert worker_zygote() is default and "PYTHONHASHSEED" not in default.env
    # At most MAX_ZYGOTES: while each has a child running (here: parked opening a fifo), a launch of
    # another environment starts fresh; once they have ended, the zygote least recently used gives
    # way to the new one (a worker whose earlier tests left several is never left without one).
    _keep_only(default)
    gate = tmp_path / "gate.fifo"
    os.mkfifo(gate)
    script = tmp_path / "parked.py"
    script.write_text("import sys\nopen(sys.argv[1]).read()\n")
    envs = [trainer_env()] + [trainer_env(TORCH_SHOW_CPP_STACKTRACES=str(i)) for i in range(1, MAX_ZYGOTES)]
    parked = [ForkedProc([sys.executable, str(script), str(gate)], env, zygote=worker_zygote(env)) for env in envs]
    assert len(support._worker_zygotes) == MAX_ZYGOTES and all(z.running() for z in support._worker_zygotes.values())
    more = trainer_env(TORCH_SHOW_CPP_STACKTRACES="more")
    fresh = Proc([sys.executable, "-m", "trainer", "--help"], env=more)
    assert type(fresh) is Proc and fresh.wait() == 0, fresh.output[-3000:]
    with open(gate, "w"):  # every parked child's open returns, and its read ends at the close
        pass
    assert [p.wait() for p in parked] == [0] * MAX_ZYGOTES
    forked = Proc([sys.executable, "-m", "trainer", "--help"], env=more)
    assert isinstance(forked, ForkedProc) and forked.wait() == 0, forked.output[-3000:]
    assert len(support._worker_zygotes) == MAX_ZYGOTES and default not in support._worker_zygotes.values()
    support.close_worker_zygote()  # the next test starts the worker's default afresh
    assert type(Proc([sys.executable, "-c", "pass"])) is Proc
    # rendezvous-id quiets c10d's C++ log through the environment before it imports torch.
    p = Proc([sys.executable, "-m", "trainer", "rendezvous-id", "--help"])
    assert type(p) is Proc and p.wait() == 0, p.output[-3000:]
    with pytest.raises(ValueError):
        Proc([sys.executable, "-c", "pass"], fork=True)


def test_a_launch_with_its_code_on_the_path_is_forked_with_the_path_a_fresh_one_has(tmp_path: Path) -> None:
    """A job's code directory after the zygote's PYTHONPATH (as a VM's code_dir): the fork puts it
    where a fresh interpreter does, and the job's module imports from it."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "probe_task.py").write_text(
        "import json, os, sys\n"
        "from trainer.tasks.gpt import build  # noqa: F401\n"
        "with open(os.environ['PROBE_OUT'], 'w') as f:\n"
        "    json.dump(sys.path, f)\n")
    paths = {}
    for fork in (True, False):
        out = tmp_path / f"path-{fork}.json"
        env = trainer_env(PYTHONPATH=os.pathsep.join([str(REPO), str(code)]), PROBE_OUT=str(out))
        p = Proc(run_args(tmp_path / f"run-{fork}", 1, write_config(tmp_path), "--task", "probe_task:build"),
                 env=env, fork=fork)
        assert isinstance(p, ForkedProc) is fork
        assert p.wait() == 0, p.output[-3000:]
        paths[fork] = json.loads(out.read_text())
    assert paths[True] == paths[False] and paths[True][1:3] == [str(REPO), str(code)]


@pytest.mark.parametrize("fork", [True, False], ids=["forked", "fresh"])
def test_a_held_run_waits_after_its_step_until_the_file_goes(tmp_path: Path, fork: bool) -> None:
    """`tests.trainer.e2e.held` (what the tests of any job signal through): forked like the trainer
    or a fresh interpreter, it holds after step 3 while the file exists, so that a SIGTERM read
    from the log of step 3 finds the run there, and once the file goes it saves and exits 75."""
    hold = tmp_path / "hold"
    hold.touch()
    argv = [sys.executable, "-m", "tests.trainer.e2e.held", *run_args(tmp_path / "run", 100000, write_config(tmp_path))[3:]]
    p = Proc(argv, env=trainer_env(HOLD_FLAG=str(hold), HOLD_AT_STEP="3"), fork=fork)
    assert isinstance(p, ForkedProc) == fork
    p.wait_for(r"event=step step=3/")
    p.signal(signal.SIGTERM)
    p.wait_for(r"event=preemption_notice reason=SIGTERM completed_step=3$")
    hold.unlink()
    assert p.wait() == 75, p.output[-3000:]
    assert "event=step step=4/" not in p.output
    p.seen(r"event=preempted step=3 persistent_ok=1")


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@pytest.mark.xdist_group("torchrun")
def test_torchrun_is_forked_as_its_agent_and_forks_its_ranks_as_torchrun_starts_them(tmp_path: Path) -> None:
    """A torchrun launch forked from the zygote (its agent, whose ranks its own rank server forks)
    and a fresh one (whose ranks are fresh `python -u -m MODULE` children) give each rank a session
    of its own, as torchrun does; a SIGTERM to the agent's group reaches the agent, which passes it
    on, and the rank saves the step it holds. All end with the same status and the same save. A
    rank the server would not start as torchrun does (here: its output teed to files) is started
    fresh by the forked agent. (One rank of the small model: what is checked is the launch; the
    multi-rank tests run forked.)"""
    held = [sys.executable.encode(), b"-u", b"-m", b"tests.trainer.e2e.held"]
    results = {}
    for case, fork, flags in [("forked", True, []), ("fresh", False, []),
                              ("teed", True, ["--tee=3", f"--log-dir={tmp_path / 'logs'}"])]:
        hold = tmp_path / f"hold-{case}"
        hold.touch()
        run = run_args(tmp_path / f"run-{case}", 100000, write_config(tmp_path))
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", *flags,
                "-m", "tests.trainer.e2e.held", *run[3:]]
        p = Proc(argv, env=trainer_env(HOLD_FLAG=str(hold), HOLD_AT_STEP="3"), new_session=True, fork=fork)
        assert isinstance(p, ForkedProc) == fork
        p.wait_for(r"event=step step=3/")
        children = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") for pid in _children(p.p.pid)}
        servers = [pid for pid, cmdline in children.items() if cmdline[:len(held)] != held]
        assert len(servers) == fork, children  # a forked agent's one other child: its rank server
        if case == "forked":
            ranks = _children(servers[0])
            want = [sys.executable.encode(), b"-m", b"tests.trainer.zygote"]  # forked, not started afresh
        else:
            ranks = [pid for pid in children if pid not in servers]
            want = held
        for pid in servers:
            assert os.getsid(pid) == pid  # out of the agent's group: a signal to it is the agent's to pass on
        assert len(ranks) == 1, ranks
        for pid in ranks:
            assert Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:len(want)] == want
            assert os.getsid(pid) == pid  # torchrun's own: each worker in a session of its own
        p.signal(signal.SIGTERM, group=True)
        open_gate_on_notice(p, hold)
        rc = p.wait()
        results[case] = (rc, p.wait_for(r"event=preempted step=(\d+) persistent_ok=1").group(1))
    assert results["forked"] == results["fresh"] == results["teed"] == (results["fresh"][0], "3"), results


def test_a_worker_script_forked_from_the_zygote_starts_as_a_fresh_one(tmp_path: Path) -> None:
    """``run_ranks``' ranks (a test's own script, ``python FILE ARGS``) are forked from the zygote:
    the script runs as ``__main__`` with the argv, the first path entry (its folder), the
    environment and the cwd a fresh interpreter gives it, and exits with its own status."""
    script = tmp_path / "probe_rank.py"
    script.write_text("import json, os, sys\n"
                      "print(json.dumps({'name': __name__, 'argv': sys.argv, 'path0': sys.path[0], 'cwd': os.getcwd(),\n"
                      "                  'rank': os.environ['RANK']}))\n"
                      "sys.exit(int(sys.argv[1]))\n")
    env = trainer_env(RANK="1")
    popen, fifo, _ = worker_zygote(env).fork(["0", "x y"], env, script=script)
    forked = json.loads(fifo.read_text())
    assert popen.wait() == 0
    fresh = subprocess.run([sys.executable, str(script), "0", "x y"], env=env, cwd=REPO, capture_output=True, text=True)
    assert fresh.returncode == 0 and forked == json.loads(fresh.stdout)
    assert forked["name"] == "__main__" and forked["path0"] == str(tmp_path) and forked["rank"] == "1"
    popen, fifo, _ = worker_zygote(env).fork(["3"], env, script=script)
    fifo.read_text()
    assert popen.wait() == 3
