"""Developer sessions: ``nox`` runs tests, typecheck and lint; see README."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import nox

nox.options.sessions = ["tests", "typecheck", "lint"]
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = True
# uv makes an environment in seconds (its files hard-linked from one cache)
# where virtualenv + pip take about a minute; nox uses it when it finds it
# (`pip install "nox[uv]"`), else virtualenv.
nox.options.default_venv_backend = "uv|virtualenv"

PYPROJECT = nox.project.load_toml("pyproject.toml")
CONSTRAINTS = ("-c", "constraints.txt")
# One inductor/triton cache for every session and run, so cold compiles are paid once.
COMPILE_CACHE = {"TORCHINDUCTOR_CACHE_DIR": os.path.abspath(".compile-cache")}
# What the shared environment holds: the tests, the examples, mypy.
DEV_GROUPS = ("test", "typecheck", "examples")
# uv, unlike pip, installs no bytecode; where PYTHONDONTWRITEBYTECODE is set
# (as on CI) every process then compiles torch's sources on import, about 2 s
# of each of the hundreds of processes the suite starts.
BYTECODE = {"UV_COMPILE_BYTECODE": "1"}


def install(session: nox.Session, *groups: str, env: dict[str, str] | None = None) -> None:
    """Installs fdp (editable) and dependency groups under the pinned constraints."""
    requirements = {r: None for g in groups for r in nox.project.dependency_groups(PYPROJECT, g)}
    # uv does not read pip's configuration: hand it pip's local wheel folder
    # (where a machine may keep its torch build) when pip has one.
    links = os.environ.get("PIP_FIND_LINKS")
    extra = {"UV_FIND_LINKS": links} if links and "UV_FIND_LINKS" not in os.environ else {}
    session.install(
        *CONSTRAINTS, "-e", ".", *requirements, env={**extra, **BYTECODE, **(env or {})}
    )


@nox.session(default=False)
def dev(session: nox.Session) -> None:
    """The one environment the tests, typecheck and example sessions share (made once)."""
    stamp = Path(session.virtualenv.location) / "fdp-installed.txt"
    files = b"".join(Path(f).read_bytes() for f in ("pyproject.toml", "constraints.txt"))
    wanted = hashlib.sha256(files + repr(BYTECODE).encode()).hexdigest()
    if stamp.exists() and stamp.read_text() == wanted:
        session.log("up to date with pyproject.toml and constraints.txt")
        return
    install(session, *DEV_GROUPS)
    stamp.write_text(wanted)


def run(session: nox.Session, program: str, *args: str, env: dict[str, str] | None = None) -> None:
    """Runs a program of the shared ``dev`` environment."""
    venv = Path(session.cache_dir).parent / "dev"
    bin_dir = venv / ("Scripts" if os.name == "nt" else "bin")
    path = {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "VIRTUAL_ENV": str(venv)}
    session.run(str(bin_dir / program), *args, env={**path, **(env or {})}, external=True)


def shared(func: Callable[[nox.Session], None]) -> Callable[[nox.Session], None]:
    """A session that runs in the ``dev`` environment (``dev`` runs first when needed)."""
    return nox.session(venv_backend="none", requires=["dev"])(func)


@shared
def tests(session: nox.Session) -> None:
    """The test suite (pytest, doctests included)."""
    # fdp's own bytecode too, for the same reason as BYTECODE (a second, once).
    run(session, "python", "-m", "compileall", "-q", "fdp", "tests", "examples")
    run(session, "pytest", *session.posargs, env=COMPILE_CACHE)


# The supported torch range, tested end to end: the floor, a middle release,
# the pin CI runs, and the newest release on the registry. Run before
# resolving anything that touches torch APIs: ``nox -s torch_range``.
TORCH_RANGE = ["2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0"]


@nox.session
@nox.parametrize("torch", TORCH_RANGE)
def torch_range(session: nox.Session, torch: str) -> None:
    """The whole suite on each torch release of the supported range (not run by default)."""
    # Releases other than the pinned CPU wheel come from the registry (CUDA
    # builds, which run on the CPU); this machine's pip cap is lifted here only.
    env = {"PIP_CONSTRAINT": os.devnull, **BYTECODE}
    tests_deps = nox.project.dependency_groups(PYPROJECT, "test")
    session.install(f"torch=={torch}", "-e", ".", *tests_deps, env=env)
    # Without constraints.txt: tests/test_packaging.py's check of the pins skips.
    session.run("pytest", *session.posargs, env={**COMPILE_CACHE, "FDP_UNPINNED": "1"})


# The Python versions pyproject.toml declares (its classifiers), each run with
# the pinned torch: ``nox -s python_range``. Checked against the classifiers by
# tests/test_packaging.py, so a declared version is one that ran.
PYTHON_RANGE = ["3.10", "3.11", "3.12"]


def interpreter(version: str) -> str | None:
    """A working ``python<version>``: on PATH, else one of pyenv's installs; None if none."""
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    found = [shutil.which(f"python{version}")]
    found += [str(p) for p in sorted(root.glob(f"versions/{version}.*/bin/python{version}"))]
    for candidate in filter(None, found):
        # A pyenv shim of a version that is not active is on PATH and fails.
        probe = subprocess.run([candidate, "-c", ""], check=False, capture_output=True)
        if probe.returncode == 0:
            return candidate
    return None


@nox.session(venv_backend="none")
@nox.parametrize("python_version", PYTHON_RANGE)
def python_range(session: nox.Session, python_version: str) -> None:
    """The whole suite on each declared Python, torch as pinned (not run by default)."""
    found = interpreter(python_version)
    if found is None:
        session.skip(f"no Python {python_version} on PATH or in pyenv")
    venv = Path(session.cache_dir).parent / f"python_range-{python_version}"
    if not (venv / "bin" / "python").exists():
        session.run(found, "-m", "venv", str(venv), external=True)
    python = str(venv / "bin" / "python")
    tests_deps = nox.project.dependency_groups(PYPROJECT, "test")
    # torch==2.13.0 for another Python is the registry's build (CUDA, runs on the CPU).
    session.run(python, "-m", "pip", "install", "-q", *CONSTRAINTS, "-e", ".", *tests_deps,
                external=True)  # fmt: skip
    session.run(python, "-m", "pytest", *session.posargs, env=COMPILE_CACHE, external=True)


@shared
def typecheck(session: nox.Session) -> None:
    """mypy --strict over the package, tests, examples and benchmarks."""
    run(session, "mypy", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff lint and format check."""
    session.install(*CONSTRAINTS, *nox.project.dependency_groups(PYPROJECT, "lint"))
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@shared
def train(session: nox.Session) -> None:
    """The main job: trains the digits classifier with data_parallel (pass args after --)."""
    run(session, "python", "examples/train_digits.py", *session.posargs, env=COMPILE_CACHE)


TORCHRUN = ("torchrun", "--standalone", "--nproc_per_node=2")


@shared
def train_ddp(session: nox.Session) -> None:
    """The same training on 2 processes with DistributedDataParallel (torchrun, gloo)."""
    run(session, *TORCHRUN, "examples/train_digits_ddp.py", *session.posargs, env=COMPILE_CACHE)


@shared
def train_cnn_ddp(session: nox.Session) -> None:
    """A conv net with sync batch norm on 2 processes with uneven shards, inside join."""
    run(session, *TORCHRUN, "examples/train_cnn_ddp.py", *session.posargs)


@shared
def train_cnn_ported(session: nox.Session) -> None:
    """A torch DDP script ported to fdp: schedule, clipping, autocast, checkpoints; -- --resume."""
    run(session, *TORCHRUN, "examples/train_cnn_ported.py", *session.posargs)


@shared
def train_zero(session: nox.Session) -> None:
    """AdamW sharded over 2 processes (fdp.ZeroRedundancy), checkpointed; -- --resume continues."""
    run(session, *TORCHRUN, "examples/train_digits_zero.py", *session.posargs)


@shared
def train_lm_fsdp(session: nox.Session) -> None:
    """A transformer LM fully sharded on 2 processes (bf16), checkpointed; -- --resume continues."""
    run(session, *TORCHRUN, "examples/train_lm_fsdp.py", *session.posargs)


@shared
def finetune_hf(session: nox.Session) -> None:
    """A Hugging Face GPT-2 on 2 ranks: DDP, or `-- --fsdp` (fsdp.wrap); `-- --compare-torch`."""
    run(session, *TORCHRUN, "examples/finetune_hf.py", *session.posargs, env=COMPILE_CACHE)


@shared
def train_meanflow(session: nox.Session) -> None:
    """A one-step MeanFlow generator on 2 processes, ddp(params) inside torch.func.jvp."""
    run(session, *TORCHRUN, "examples/train_meanflow.py", *session.posargs, env=COMPILE_CACHE)


@shared
def train_contrastive(session: nox.Session) -> None:
    """InfoNCE with global negatives (fdp.all_gather) on 2 processes; -- --compile."""
    script = "examples/train_contrastive.py"
    run(session, *TORCHRUN, script, *session.posargs, env=COMPILE_CACHE)


@shared
def train_fault_tolerant(session: nox.Session) -> None:
    """The fault drill: a torchft lighthouse, 3 replica groups, one SIGKILLed and healed."""
    run(session, "python", "examples/train_fault_tolerant.py", "--drill", *session.posargs)


@shared
def train_diloco(session: nox.Session) -> None:
    """DiLoCo against DDP on 2 processes, same data and budget: accuracy and bytes."""
    run(session, *TORCHRUN, "examples/train_diloco.py", *session.posargs)


@shared
def figures(session: nox.Session) -> None:
    """Redraws the docs' generated figures (docs/figures/) from measured runs."""
    run(session, "python", "benchmarks/figures.py")
    plot = ("--plot", "docs/figures/memory_per_rank.png")
    run(session, "python", "benchmarks/fsdp_memory.py", "--quick", *plot, env=COMPILE_CACHE)


@shared
def examples(session: nox.Session) -> None:
    """Runs every example briefly."""
    run(session, "python", "examples/train_digits.py", "--epochs", "2", "--min-accuracy", "0")
    run(session, *TORCHRUN, "examples/train_digits_ddp.py", "--epochs", "2", "--min-accuracy", "0")
    # torch's PowerSGD hook, unmodified, trains to the accuracy of the plain average.
    run(session, *TORCHRUN, "examples/train_digits_ddp.py", "--powersgd", "--min-accuracy", "0.95")
    # BatchNorm over both ranks, buffers broadcast, shards of 70% and 30% inside join.
    run(session, *TORCHRUN, "examples/train_cnn_ddp.py", "--min-accuracy", "0.95")
    # A torch DDP script ported to fdp (schedule, clipping, autocast, checkpoints).
    directory = os.path.join(session.create_tmp(), "cnn_ported")
    shutil.rmtree(directory, ignore_errors=True)
    run(session, *TORCHRUN, "examples/train_cnn_ported.py", "--checkpoint-dir", directory)
    # ZeRO with checkpoints: 3 epochs (saved at step 30 and at the end, step 36),
    # then resumed from step 36 to epoch 40.
    directory = os.path.join(session.create_tmp(), "zero")
    shutil.rmtree(directory, ignore_errors=True)  # no checkpoint of an earlier run
    ckpt = ("--checkpoint-dir", directory, "--checkpoint-every")
    zero = (*TORCHRUN, "examples/train_digits_zero.py", *ckpt, "30")
    run(session, *zero, "--epochs", "3", "--min-accuracy", "0")
    run(session, *zero, "--resume", "--min-accuracy", "0.95")
    # A fully sharded language model: 30 steps (checkpointed at 15 and 30), resumed to 40.
    directory = os.path.join(session.create_tmp(), "lm_fsdp")
    shutil.rmtree(directory, ignore_errors=True)
    lm = (*TORCHRUN, "examples/train_lm_fsdp.py", "--checkpoint-dir", directory)
    run(session, *lm, "--steps", "30", "--checkpoint-every", "15", "--loss-threshold", "2.5")
    run(session, *lm, "--resume", "--steps", "40", "--loss-threshold", "2.5")
    # MeanFlow: ddp(params) inside jvp, eager and compiled; one-step samples within the MMD bound.
    run(session, *TORCHRUN, "examples/train_meanflow.py")
    run(session, *TORCHRUN, "examples/train_meanflow.py", "--compile", env=COMPILE_CACHE)
    # Contrastive, global negatives through fdp.all_gather: eager and compiled, briefly.
    contrastive = (*TORCHRUN, "examples/train_contrastive.py", "--epochs", "2")
    run(session, *contrastive, "--min-accuracy", "0")
    run(session, *contrastive, "--compile", "--min-accuracy", "0", env=COMPILE_CACHE)
    # Per-step fault tolerance (torchft): a replica group killed at step 50 heals; 150 steps.
    drill = ("examples/train_fault_tolerant.py", "--drill", "--steps", "150", "--kill-at", "50")
    run(session, "python", *drill)
    # DiLoCo against DDP: 200 steps, H=10, the pseudo-gradient in bf16.
    diloco = ("examples/train_diloco.py", "--steps", "200", "--sync-every", "10")
    run(session, *TORCHRUN, *diloco, "--sync-dtype", "bfloat16", "--min-accuracy", "0.85")
    # Streaming DiLoCo: 4 fragments, each landing a step after it is sent, int8 on the wire.
    streaming = ("--fragments", "4", "--overlap", "1", "--sync-dtype", "int8")
    run(session, *TORCHRUN, *diloco, *streaming, "--min-accuracy", "0.85")
    # The same on the character LM (4 blocks, 200 steps), plain DiLoCo beside it.
    lm_diloco = ("--model", "lm", "--steps", "200", "--blocks", "4", "--batch-size", "32")
    run(session, *TORCHRUN, "examples/train_diloco.py", *lm_diloco, *streaming, "--max-loss", "0.5")
    for script in ("train_digits.py", "train_digits_ddp.py"):
        launch = ("python",) if script == "train_digits.py" else TORCHRUN
        run(
            session,
            *launch, f"examples/{script}", "--compile", "--epochs", "2", "--min-accuracy", "0",
            env=COMPILE_CACHE,
        )  # fmt: skip


@shared
def bench(session: nox.Session) -> None:
    """Benchmarks (ratios measured side by side in one run); not run by default.

    Every script records its figures in benchmarks/results.json, and the
    pages that quote them are rewritten from it (benchmarks/results.py).
    """
    recorded = {"FDP_BENCH_RESULTS": os.path.abspath("benchmarks/results.json")}

    def script(name: str, *args: str, compiles: bool = False) -> None:
        env = recorded | (COMPILE_CACHE if compiles else {})
        run(session, "python", f"benchmarks/{name}", *args, *session.posargs, env=env)

    run(session, "python", "benchmarks/structure.py")  # modules, sizes, imports, one step's path
    script("bench_import.py")
    script("bench_data_parallel.py")
    script("bench_train.py")
    if shutil.which("valgrind"):  # instruction counts: steady where timings are noisy
        script("count_instructions.py", "--stages")
    else:
        session.log("benchmarks/count_instructions.py skipped: it needs valgrind")
    script("bench_distributed.py")
    script("bench_ddp_step.py", "--compiled")
    script("bench_ddp_call.py")
    script("bench_ddp_host.py")
    script("bench_optim.py", compiles=True)
    script("bench_zero.py")
    script("bench_fault_tolerance.py")
    script("bench_compression.py")
    script("bench_meanflow.py", "--compile", compiles=True)
    run(session, "python", "benchmarks/zero_memory.py")
    script("bench_fsdp_accumulate.py")
    script("bench_collectives.py")
    script("fsdp_memory.py", "--plot", "docs/figures/memory_per_rank.png", compiles=True)
    script("bench_models.py")
    script("bench_models_step.py", compiles=True)
    script("bench_ddp_phases.py")
    script("bench_compile_time.py")  # caches of its own: cold, then warm
    script("bench_trace_time.py")  # dynamo alone: no cache involved
    script("bench_muon.py")
    script("bench_diloco.py")
    script("bench_pack_order.py", compiles=True)
    run(session, "python", "benchmarks/figures.py")  # the timelines in docs/figures/
    run(session, "python", "benchmarks/results.py", "--write")  # the pages' figures
