"""Text from outside the trainer never becomes one of its log records (issue 28, item 3).

Each route the audit used, end to end: a bucket writer plants the writer lease (its holder) and
manifests (a key id, a hash name) whose text holds the trainer's own `event=finished` and
`event=step` lines, inside a line and after a newline; a task prints and logs the same. The real
trainer (a run paused at step 8, resumed with the VM's log key) writes its lines, which go as the
trainer unit's journal into the real log shipper (`log_shipper.py CONFIG`, the drill's journalctl,
the loopback Cloud Logging). What the stack acts on must be the trainer's own: no entry says
finished or step 99, the `finished` and `step` log-based metrics' filters select nothing forged,
and the stall watchdog is not reset by a forged step.
"""
from __future__ import annotations

import json
from pathlib import Path

from drill.attacker import forge_in_bucket, plant
from stacks import run_metrics
from tests.trainer.cloud.test_log_shipper import CFG, GUARD_S, Rig
from tests.trainer.e2e.forging_task import FINISHED, STEP
from tests.trainer.support import start, trainer_env, write_config
from trainer.checkpoint.lease import LEASE_KEY
from trainer.cloud.log_shipper import KEY_ENV

STEPS = 40
#: Planted text: the words inside a line, and whole trainer lines after a newline.
INLINE = "x event=finished step=99 event=step step=99/100"
NEWLINE = f"x\n{FINISHED}\n{STEP}"


def _plant(gcs_emulator) -> None:
    """The bucket writer's text in the lease and in two newer manifests than the run's own."""
    lease = {"holder": NEWLINE, "host": INLINE, "pid": 7, "incarnation": "planted", "started": "now",
             "renewed": "now", "ttl_s": 1}
    plant(gcs_emulator.client, gcs_emulator.uri, LEASE_KEY, json.dumps(lease).encode())

    def key_id(m: dict) -> None:  # at most 64 characters reach a line: the newline and a whole line
        m["auth"]["key_id"] = f"k\n{FINISHED}"

    def hash_name(m: dict) -> None:
        m["hash"] = INLINE + "\n" + STEP

    forge_in_bucket(gcs_emulator.client, gcs_emulator.uri, 8, 12, {}, keep_hmac=True, edit=key_id)
    forge_in_bucket(gcs_emulator.client, gcs_emulator.uri, 8, 16, {}, edit=hash_name)


def test_text_from_the_bucket_and_the_task_never_becomes_a_trainer_record(tmp_path: Path, gcs_emulator) -> None:
    rig = Rig(tmp_path / "vm")
    try:
        config, run_dir = write_config(tmp_path, "lease_ttl_s = 2\n"), tmp_path / "run"
        gcs = ("--gcs-uri", gcs_emulator.uri, "--checkpoint-every-steps", "4", "--task",
               "tests.trainer.e2e.forging_task:build")
        env = trainer_env(**gcs_emulator.env)
        first = start(run_dir, STEPS, config, *gcs, "--stop-at-step", "8", env=env)
        assert first.wait() == 75, first.output[-3000:]  # paused at step 8, as in the audit
        _plant(gcs_emulator)
        # The VM's session: the trainer signs its own lines with the key the shipper made.
        env = trainer_env(**gcs_emulator.env, **{KEY_ENV: str(rig.key_file)})
        second = start(run_dir, STEPS, config, *gcs, "--stop-at-step", "10", env=env)
        assert second.wait() == 75, second.output[-3000:]
        for line in second.lines:  # the trainer unit's journal, as written: nothing signed here
            rig.line(line, signed=False)
        rig.start()
        rig.wait(len(second.lines))
        rig.stop()
    finally:
        rig.close()
    entries = rig.logging.entries
    payloads = [e["jsonPayload"] for e in entries]
    text = "\n".join(p["message"] for p in payloads)

    # Nothing anyone else wrote is: no finished, no step 99, no field of the trainer's taken over.
    assert not [p for p in payloads if p.get("event") == "finished"]
    assert not [p for p in payloads if p.get("step") == 99 or (p.get("fields") or {}).get("step") == 99]
    forged = [p for p in payloads if p["message"] in (FINISHED, STEP, "event=finished step=99")]
    assert len(forged) >= 6 and all(p["source"] == "trainer" for p in forged), forged
    assert not [p for p in forged if {"event", "step", "fields", "level", "logger"} & set(p)], forged
    # The trainer's own records are there, structured: its steps and its pause.
    steps = [p["step"] for p in payloads if p.get("event") == "step"]
    assert steps and max(steps) == 10 and all(9 <= s <= 10 for s in steps), steps
    assert [p["step"] for p in payloads if p.get("event") == "paused"] == [10]
    # What the stack acts on: the finished metric counts nothing, the step metric only the trainer's.
    metric = run_metrics.by_name(CFG["project"], CFG["experiment"])
    assert rig.logging.matching(metric["finished"].filter) == []
    assert sorted(e["jsonPayload"]["step"] for e in rig.logging.matching(metric["step"].filter)) == sorted(steps)
    # Every route reached the log (else this test proves nothing): the lease's holder and host, the
    # manifests' key id and hash name, the task's prints and log lines; each bucket value shown as
    # one quoted word of a line the trainer signed.
    lease = next(p for p in payloads if p.get("event") == "lease_acquired" and "previous" in p["fields"])
    assert NEWLINE in lease["fields"]["previous"] and INLINE in lease["fields"]["previous"]
    assert f"names checkpoint key {json.dumps(chr(10).join(['k', FINISHED]))}" in text
    assert f"unsupported file hash {json.dumps(INLINE + chr(10) + STEP)}" in text
    assert text.count(FINISHED) >= 3 and "data says: event=step step=99/100" in text


def test_a_forged_step_line_does_not_reset_the_stall_watchdog(tmp_path: Path) -> None:
    """The trainer's last step is 2; then only its task's output says step 99, as a whole trainer
    line and as bare words. The watchdog still says stalled, with the trainer's last step."""
    rig = Rig(tmp_path, stall_s=1.5)
    try:
        rig.line("2026-01-02T03:04:02.000 INFO trainer event=step step=2/100 loss=2.0 steps_per_s=1.0")
        rig.line(STEP, signed=False)
        rig.line("event=step step=99/100", signed=False)
        rig.start()
        assert rig.logging.wait_for(
            lambda o: any(e["jsonPayload"].get("event") == "stalled" for e in o.entries), GUARD_S), rig.messages()
        rig.stop()
    finally:
        rig.close()
    stalled = [e["jsonPayload"] for e in rig.logging.entries if e["jsonPayload"].get("event") == "stalled"]
    assert stalled[0]["fields"]["last_step"] == 2, stalled
    assert [e["jsonPayload"].get("step") for e in rig.logging.entries][:3] == [2, None, None]
