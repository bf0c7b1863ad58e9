"""docs/bring-your-own-model.md, run as written: its commands cannot rot.

Every fenced block of the page carries a marker in the HTML comment just above it (invisible once
rendered), or is a ```text block (output, a file tree):

- `<!-- walkthrough: setup -->`: the shell set-up the suite provides itself (the venv exists); its
  `source ...` lines start every block below.
- `<!-- walkthrough: run [expect="..."] -->`: run in document order, each block in a fresh bash
  (`set -e`) in a scratch copy of the repository (symlinks to every top-level entry, so the
  page's `runs/` lands in the scratch folder); it must exit 0 and print `expect`.
- `<!-- walkthrough: root [expect="..."] -->`: the same, only as root (`sudo` is then a no-op):
  the drill of the example experiment.
- `<!-- walkthrough: cloud -->`: what needs a Google Cloud project, checked for shape instead, line
  by line: `make deploy|diff|destroy|output EXPERIMENT=NAME` runs its target with `--dry-run` and
  a stand-in `terraform`; a `gcloud` line must equal one of the synthesized stack's outputs; a
  `python -m trainer status|export --gcs-uri URI` line must name the stack's `checkpoint_uri` and
  runs as written against gcp-storage-emulator, whose bucket holds a short run trained with the
  experiment's own `[trainer.config]` (a stand-in for the VM: the drill is what proves the VM's
  boot path). Any other line fails the test: nothing on the page goes unchecked.
- `<!-- walkthrough: excerpt PATH -->`: the block must be a verbatim part of that file.

Beyond exit statuses, the example itself must work: the loss falls, samples/s counts samples, the
held-out accuracy is far above chance, and the exported weights, batch norm's running statistics
included, load with `strict=True` into `shapes.model.ResNet`.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "bring-your-own-model.md"
EXAMPLE = ROOT / "examples" / "cnn"
FRESH_PATH = "/usr/bin:/bin"
SUDO_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # sudo's secure_path
MARKER = re.compile(r"^<!-- walkthrough: (setup|run|root|cloud|excerpt)(?: (.*?))? -->$")
FENCE = re.compile(r"^```(\w*)$")
DEPLOY_VERBS = ("deploy", "diff", "destroy", "output")
BLOCK_TIMEOUT_S = 600


@dataclass(frozen=True)
class Block:
    kind: str  # setup, run, root, cloud, excerpt, or "" for an unmarked block
    arg: str
    lang: str
    text: str
    line: int  # of the opening fence, 1-based

    @property
    def expect(self) -> str | None:
        m = re.fullmatch(r'expect="([^"]*)"', self.arg)
        return m.group(1) if m else None

    def where(self) -> str:
        return f"{DOC.relative_to(ROOT)}:{self.line}"


def parse(text: str) -> list[Block]:
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j] == "```")
        above = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.match(above)
        kind, arg = (marker.group(1), marker.group(2) or "") if marker else ("", "")
        blocks.append(Block(kind, arg, m.group(1), "\n".join(lines[i + 1:end]) + "\n", i + 1))
        i = end + 1
    return blocks


BLOCKS = parse(DOC.read_text())


def example(module: str) -> Any:
    """A module of examples/cnn, imported as the trainer imports the user's code (its directory
    on the path)."""
    sys.path.insert(0, str(EXAMPLE))
    try:
        return importlib.import_module(module)
    finally:
        sys.path.remove(str(EXAMPLE))


# --- the page's own rules --------------------------------------------------------------------------


def test_every_block_is_marked_or_is_output():
    """A command block without a marker would go untested; so would a stray marker."""
    unmarked = [b.where() for b in BLOCKS if not b.kind and b.lang != "text"]
    assert unmarked == []
    text = DOC.read_text()
    assert text.count("<!-- walkthrough:") == sum(1 for b in BLOCKS if b.kind)
    kinds = {b.kind for b in BLOCKS}
    assert {"setup", "run", "root", "cloud", "excerpt"} <= kinds


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.kind == "excerpt"], ids=lambda b: b.arg)
def test_excerpts_are_the_files_own_lines(block):
    assert block.text in (ROOT / block.arg).read_text(), f"{block.where()}: not a part of {block.arg}"


def test_relative_links_reach_their_files_and_headings():
    """Links into docs/ and the repository resolve; an anchor names a heading of its file (the
    concepts the page leans on among them: tests/test_docs.py checks every page the same way)."""
    concepts = []
    for target in re.findall(r"\]\(([^)\s]+)\)", DOC.read_text()):
        if re.match(r"\w+://", target):
            continue
        path, _, anchor = target.partition("#")
        file = (DOC.parent / path).resolve() if path else DOC
        assert file.exists(), target
        if anchor:
            assert anchor in _anchors(file.read_text()), target
        if path == "concepts.md":
            concepts.append(anchor)
    assert {"fingerprint", "goodput", "pools", "tiers"} <= set(concepts)


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    found = set()
    for heading in re.findall(r"^#+ (.+)$", markdown, flags=re.M):
        found.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return found


def test_the_errors_the_page_quotes_are_the_ones_a_typo_gets(tmp_path):
    """The page quotes what a typo in the experiment gives; the same typo must give it."""
    from stacks.load import ExperimentError, load_file

    text = DOC.read_text()
    experiment = ROOT / "experiments" / "cnn.toml"
    quoted = re.findall(r"`(experiments/cnn\.toml: [^`]+)`", text)
    assert quoted
    for line in quoted:
        field = line.split(": ")[1]  # trainer.config.batch_sise
        wrong = field.rsplit(".", 1)[1]
        right = re.search(r"did you mean '(\w+)'", line).group(1)
        typo = tmp_path / "cnn.toml"
        typo.write_text(experiment.read_text().replace(f"\n{right} = ", f"\n{wrong} = ", 1))
        with pytest.raises(ExperimentError) as info:
            load_file(typo)
        assert any(got.startswith(line.replace("experiments/cnn.toml", str(typo), 1))
                   for got in info.value.lines), info.value.lines


def test_the_example_experiment_states_its_models_true_size():
    """param_count sizes the emergency save and the storage estimate: it is the model that the
    experiment's task_args build. And evaluate.py leans on ResNet's and Shapes' defaults being
    build()'s, for a size a run leaves out."""
    import inspect
    import tomllib

    Shapes, ResNet = example("shapes.data").Shapes, example("shapes.model").ResNet
    build = example("shapes.task").build
    trainer = tomllib.loads((ROOT / "experiments" / "cnn.toml").read_text())["trainer"]
    args = trainer["config"]["task_args"]
    model = ResNet(width=args["width"], blocks=args["blocks"])
    assert trainer["param_count"] == sum(p.numel() for p in model.parameters())
    defaults = {k: p.default for k, p in inspect.signature(build).parameters.items()}
    resnet = inspect.signature(ResNet).parameters
    assert (defaults["width"], defaults["blocks"]) == (resnet["width"].default, resnet["blocks"].default)
    assert defaults["image_size"] == inspect.signature(Shapes).parameters["image_size"].default


# --- running the page --------------------------------------------------------------------------------


def scratch_repo(tmp_path: Path) -> Path:
    """The repository as a user's checkout, but whatever the page writes stays in tmp_path."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in (".git", "runs", "cdktf.out", ".pytest_cache"):
            (repo / entry.name).symlink_to(entry)
    return repo


def base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PATH", "VIRTUAL_ENV", "PYTHONPATH", "MAKEFLAGS", "MAKELEVEL",
                        "STORAGE_EMULATOR_HOST")}
    return {**env, "PATH": FRESH_PATH, **extra}


def prelude(root: bool = False) -> str:
    """The page's own set-up lines (not `make setup`: the suite's venv is there), and `make` that
    treats the environment as set up, as tests/test_make.py does."""
    (setup,) = [b for b in BLOCKS if b.kind == "setup"]
    sources = [line for line in setup.text.splitlines() if line.startswith("source ")]
    assert sources == ["source .venv/bin/activate"]
    lines = ["set -e", *sources,
             'make() { command make --no-print-directory -o .venv/.setup-stamp "$@"; }']
    if root:
        lines.append(f'sudo() {{ PATH="{SUDO_PATH}" "$@"; }}  # already root: only sudo\'s PATH')
    return "\n".join(lines) + "\n"


def run_block(repo: Path, block: Block, env: dict[str, str], root: bool = False,
              script: str | None = None) -> str:
    proc = subprocess.run(["bash", "-c", prelude(root) + (script if script is not None else block.text)],
                          cwd=repo, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{block.where()} exited {proc.returncode}:\n{out[-6000:]}"
    assert "Traceback" not in out, f"{block.where()}:\n{out[-6000:]}"
    if block.expect is not None:
        assert block.expect in out, f"{block.where()}: no {block.expect!r} in:\n{out[-6000:]}"
    return out


class Cloud:
    """What the page's cloud blocks are checked against: the experiment synthesized, a stand-in
    `terraform`, and its bucket in gcp-storage-emulator holding a short run."""

    def __init__(self, tmp_path: Path, experiment: str) -> None:
        self.tmp, self.experiment = tmp_path, experiment
        self.file = ROOT / "experiments" / f"{experiment}.toml"
        self.outputs = self._synthesize()
        self.uri = self.outputs["checkpoint_uri"]
        self.bin = tmp_path / "bin"
        self.bin.mkdir()
        (self.bin / "terraform").write_text("#!/bin/sh\necho 'Terraform v1.9.0'\n")
        (self.bin / "terraform").chmod(0o755)
        self.emulator: Any = None

    def _synthesize(self) -> dict[str, str]:
        out = self.tmp / "cdktf.out"
        env = base_env(SPOTTRAIN_EXPERIMENTS=str(self.file), CDKTF_OUTDIR=str(out),
                       CHECKPOINT_DISABLE="1", DISABLE_VERSION_CHECK="1")
        proc = subprocess.run([sys.executable, str(ROOT / "main.py")], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        stack = json.loads((out / "stacks" / self.experiment / "cdk.tf.json").read_text())
        return {k: v["value"] for k, v in stack["output"].items()}

    def gcs_env(self) -> dict[str, str]:
        """The emulator, its bucket holding a run at checkpoint_uri (started on first use)."""
        if self.emulator is None:
            from drill.gcs_emulator import StorageEmulator
            from stacks.load import load_file
            from stacks.trainer_config import to_toml

            bucket = self.uri.removeprefix("gs://").split("/", 1)[0]
            self.emulator = StorageEmulator(bucket, quiet=True).start()
            spec = load_file(self.file).spec
            config = self.tmp / "trainer.toml"  # what the VM's trainer reads with --config
            config.write_text(to_toml(spec.trainer.config))
            env = self._env()
            from stacks.experiment import code_path

            env["PYTHONPATH"] = f"{code_path(spec.trainer.code_dir)}:{ROOT}"
            proc = subprocess.run(
                [sys.executable, "-m", "trainer", "run", "--config", str(config), "--run-dir",
                 str(self.tmp / "vm-disk"), "--steps", "20", "--task", spec.trainer.task,
                 "--gcs-uri", self.uri, "--health-port", "0", "--checkpoint-every-steps", "10"],
                cwd=ROOT, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
            assert proc.returncode == 0, proc.stderr[-6000:]
        return self._env()

    def _env(self) -> dict[str, str]:
        return base_env(STORAGE_EMULATOR_HOST=self.emulator.host, GOOGLE_CLOUD_PROJECT="spottrain-test")

    def close(self) -> None:
        if self.emulator is not None:
            self.emulator.stop()


def check_cloud_block(repo: Path, block: Block, cloud: Cloud) -> list[str]:
    """Each line of a cloud block, checked as the module docstring says; the outputs of the lines
    that ran."""
    outputs = []
    for line in block.text.splitlines():
        words = shlex.split(line, comments=True)
        if not words:
            continue
        if words[:2] == ["make", "preflight"]:
            # Without credentials it says what it would check: the name resolves, the file is valid.
            proc = subprocess.run(
                ["make", "--no-print-directory", "-o", ".venv/.setup-stamp", *words[1:]], cwd=repo,
                env=base_env(GOOGLE_APPLICATION_CREDENTIALS=str(cloud.tmp / "none.json"),
                             HOME=str(cloud.tmp), NO_GCE_CHECK="True",
                             GCE_METADATA_HOST="127.0.0.1:9"),  # nothing listens on the discard port
                capture_output=True, text=True, timeout=120)
            assert "no usable application-default credentials" in proc.stderr, proc.stderr
            assert f"  {cloud.experiment}: GPU quota " in proc.stderr, proc.stderr
        elif words[0] == "make":
            verb, *rest = words[1:]
            assert verb in DEPLOY_VERBS and rest == [f"EXPERIMENT={cloud.experiment}"], \
                f"{block.where()}: {line!r}: a make line the suite does not know how to check"
            proc = subprocess.run(
                ["make", "--no-print-directory", "-o", ".venv/.setup-stamp", verb, *rest,
                 "CDKTN_ARGS=--dry-run"], cwd=repo, env=base_env(PATH=f"{cloud.bin}:{FRESH_PATH}"),
                capture_output=True, text=True, timeout=120)
            assert proc.returncode == 0, f"{block.where()}: {line!r}:\n{proc.stderr}"
            assert proc.stdout.splitlines()[-1].endswith(f"npx cdktn {verb} {cloud.experiment}"), proc.stdout
        elif words[0] == "gcloud":
            assert " ".join(words) in cloud.outputs.values(), \
                f"{block.where()}: {line!r} is none of the stack's outputs: {sorted(cloud.outputs.values())}"
        elif words[:3] == ["python", "-m", "trainer"] and words[3] in ("status", "export"):
            uri = words[words.index("--gcs-uri") + 1]
            assert uri == cloud.uri, f"{block.where()}: {uri} is not the stack's checkpoint_uri {cloud.uri}"
            outputs.append(run_block(repo, block, cloud.gcs_env(), script=line + "\n"))
        else:
            pytest.fail(f"{block.where()}: {line!r}: a cloud command the suite cannot check")
    return outputs


def _cloud_experiment() -> str:
    names = {w.removeprefix("EXPERIMENT=") for b in BLOCKS if b.kind == "cloud"
             for w in shlex.split(b.text, comments=True) if w.startswith("EXPERIMENT=")}
    assert len(names) == 1, names
    return names.pop()


def test_the_walkthrough_runs_as_written(tmp_path):
    repo = scratch_repo(tmp_path)
    cloud = Cloud(tmp_path, _cloud_experiment())
    outputs: list[tuple[Block, str]] = []
    try:
        for block in BLOCKS:
            if block.kind == "run":
                outputs.append((block, run_block(repo, block, base_env())))
            elif block.kind == "cloud":
                outputs += [(block, out) for out in check_cloud_block(repo, block, cloud)]
    finally:
        cloud.close()
    text = "\n".join(out for _, out in outputs)

    # The local run trains visibly, and its log counts samples, not steps, per second.
    steps = [(float(m["loss"]), float(m["steps"]), float(m["samples"])) for m in re.finditer(
        r"event=step step=\d+/300 loss=(?P<loss>\S+) \S+ steps_per_s=(?P<steps>\S+) samples_per_s=(?P<samples>\S+)",
        outputs[0][1])]
    assert len(steps) == 30
    assert steps[0][0] > 2.0 and steps[-1][0] < 0.5 * steps[0][0], steps
    assert all(samples == pytest.approx(32 * rate, abs=1.0) for _, rate, samples in steps)
    # It learned the shapes: held-out accuracy far above chance (1/8).
    accuracy = [float(a) for a in re.findall(r"step 300: accuracy (\S+) on 2000 held-out images", text)]
    assert accuracy and accuracy[0] > 0.6, text
    # The VM's export (the emulator's bucket) and the preempted local run's own export load with
    # strict=True, batch norm's running statistics with them: the preempted run counts every
    # batch, so its buffers came through the SIGTERM's checkpoint and the resume.
    assert "step 20: accuracy" in text
    assert _batches_tracked(repo / "runs" / "cnn-vm.safetensors") == 20
    assert _batches_tracked(repo / "runs" / "cnn-preempted" / "export" / "step-00000300" / "model.safetensors") == 300


def _batches_tracked(weights: Path) -> int:
    import torch
    from safetensors.torch import load_file

    ResNet = example("shapes.model").ResNet
    args = json.loads(weights.with_suffix(".json").read_text())["task_args"]
    model = ResNet(width=args["width"], blocks=args["blocks"])
    state = load_file(str(weights))
    model.load_state_dict(state, strict=True)
    assert not torch.equal(model.stem[1].running_var, torch.ones_like(model.stem[1].running_var))
    counts = {int(v) for k, v in state.items() if k.endswith("num_batches_tracked")}
    assert len(counts) == 1, counts
    return counts.pop()


@pytest.mark.skipif(os.geteuid() != 0 or not all(shutil.which(t, path=SUDO_PATH) for t in ("unshare", "losetup")),
                    reason="the drill needs root, unshare and losetup (namespaces, loop devices)")
def test_the_walkthroughs_drill_runs_as_written(tmp_path):
    repo = scratch_repo(tmp_path)
    roots = [b for b in BLOCKS if b.kind == "root"]
    assert roots
    for block in roots:
        run_block(repo, block, base_env(), root=True)
