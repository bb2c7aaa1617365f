"""Developer sessions: ``nox`` runs tests, typecheck and lint; see README."""

from __future__ import annotations

import os
import shutil

import nox

nox.options.sessions = ["tests", "typecheck", "lint"]
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = True

PYPROJECT = nox.project.load_toml("pyproject.toml")
CONSTRAINTS = ("-c", "constraints.txt")
# One inductor/triton cache for every session and run, so cold compiles are paid once.
COMPILE_CACHE = {"TORCHINDUCTOR_CACHE_DIR": os.path.abspath(".compile-cache")}


def install(session: nox.Session, *groups: str) -> None:
    """Installs fdp (editable) and dependency groups under the pinned constraints."""
    requirements = [r for g in groups for r in nox.project.dependency_groups(PYPROJECT, g)]
    session.install(*CONSTRAINTS, "-e", ".", *requirements)


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite (pytest, doctests included)."""
    install(session, "test")
    session.run("pytest", *session.posargs, env=COMPILE_CACHE)


# The supported torch range, tested end to end: the floor, a middle release,
# the pin CI runs, and the newest release on the registry. Run before
# resolving anything that touches torch APIs: ``nox -s torch_range``.
TORCH_RANGE = ["2.11.0", "2.12.1", "2.13.0", "2.15.0"]


@nox.session
@nox.parametrize("torch", TORCH_RANGE)
def torch_range(session: nox.Session, torch: str) -> None:
    """The whole suite on each torch release of the supported range (not run by default)."""
    # Releases other than the pinned CPU wheel come from the registry (CUDA
    # builds, which run on the CPU); this machine's pip cap is lifted here only.
    env = {"PIP_CONSTRAINT": os.devnull}
    tests_deps = nox.project.dependency_groups(PYPROJECT, "test")
    session.install(f"torch=={torch}", "-e", ".", *tests_deps, env=env)
    session.run("pytest", *session.posargs, env=COMPILE_CACHE)


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict over the package, tests, examples and benchmarks."""
    install(session, "typecheck")
    session.run("mypy", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff lint and format check."""
    session.install(*CONSTRAINTS, *nox.project.dependency_groups(PYPROJECT, "lint"))
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def train(session: nox.Session) -> None:
    """The main job: trains the digits classifier with data_parallel (pass args after --)."""
    install(session, "examples")
    session.run("python", "examples/train_digits.py", *session.posargs, env=COMPILE_CACHE)


TORCHRUN = ("torchrun", "--standalone", "--nproc_per_node=2")


@nox.session
def train_ddp(session: nox.Session) -> None:
    """The same training on 2 processes with DistributedDataParallel (torchrun, gloo)."""
    install(session, "examples")
    session.run(*TORCHRUN, "examples/train_digits_ddp.py", *session.posargs, env=COMPILE_CACHE)


@nox.session
def train_cnn_ddp(session: nox.Session) -> None:
    """A conv net with sync batch norm on 2 processes with uneven shards, inside join."""
    install(session, "examples")
    session.run(*TORCHRUN, "examples/train_cnn_ddp.py", *session.posargs)


@nox.session
def train_zero(session: nox.Session) -> None:
    """AdamW sharded over 2 processes (fdp.ZeroRedundancy), checkpointed; -- --resume continues."""
    install(session, "examples")
    session.run(*TORCHRUN, "examples/train_digits_zero.py", *session.posargs)


@nox.session
def train_lm_fsdp(session: nox.Session) -> None:
    """A transformer LM fully sharded on 2 processes (bf16), checkpointed; -- --resume continues."""
    install(session, "examples")
    session.run(*TORCHRUN, "examples/train_lm_fsdp.py", *session.posargs)


@nox.session
def train_meanflow(session: nox.Session) -> None:
    """A one-step MeanFlow generator on 2 processes, ddp(params) inside torch.func.jvp."""
    install(session, "examples")
    session.run(*TORCHRUN, "examples/train_meanflow.py", *session.posargs, env=COMPILE_CACHE)


@nox.session
def examples(session: nox.Session) -> None:
    """Runs every example briefly."""
    install(session, "examples")
    session.run("python", "examples/train_digits.py", "--epochs", "2", "--min-accuracy", "0")
    session.run(*TORCHRUN, "examples/train_digits_ddp.py", "--epochs", "2", "--min-accuracy", "0")
    # torch's PowerSGD hook, unmodified, trains to the accuracy of the plain average.
    session.run(*TORCHRUN, "examples/train_digits_ddp.py", "--powersgd", "--min-accuracy", "0.95")
    # BatchNorm over both ranks, buffers broadcast, shards of 70% and 30% inside join.
    session.run(*TORCHRUN, "examples/train_cnn_ddp.py", "--min-accuracy", "0.95")
    # ZeRO with checkpoints: 3 epochs (saved at step 30 and at the end, step 36),
    # then resumed from step 36 to epoch 40.
    directory = os.path.join(session.create_tmp(), "zero")
    shutil.rmtree(directory, ignore_errors=True)  # no checkpoint of an earlier run
    ckpt = ("--checkpoint-dir", directory, "--checkpoint-every")
    zero = (*TORCHRUN, "examples/train_digits_zero.py", *ckpt, "30")
    session.run(*zero, "--epochs", "3", "--min-accuracy", "0")
    session.run(*zero, "--resume", "--min-accuracy", "0.95")
    # A fully sharded language model: 30 steps (checkpointed at 15 and 30), resumed to 40.
    directory = os.path.join(session.create_tmp(), "lm_fsdp")
    shutil.rmtree(directory, ignore_errors=True)
    lm = (*TORCHRUN, "examples/train_lm_fsdp.py", "--checkpoint-dir", directory)
    session.run(*lm, "--steps", "30", "--checkpoint-every", "15", "--loss-threshold", "2.5")
    session.run(*lm, "--resume", "--steps", "40", "--loss-threshold", "2.5")
    # MeanFlow: ddp(params) inside jvp, eager and compiled; one-step samples within the MMD bound.
    session.run(*TORCHRUN, "examples/train_meanflow.py")
    session.run(*TORCHRUN, "examples/train_meanflow.py", "--compile", env=COMPILE_CACHE)
    for script in ("train_digits.py", "train_digits_ddp.py"):
        launch = ("python",) if script == "train_digits.py" else TORCHRUN
        session.run(
            *launch, f"examples/{script}", "--compile", "--epochs", "2", "--min-accuracy", "0",
            env=COMPILE_CACHE,
        )  # fmt: skip


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks (ratios measured side by side in one run); not run by default."""
    install(session, "examples")
    session.run("python", "benchmarks/bench_data_parallel.py", *session.posargs)
    session.run("python", "benchmarks/bench_train.py", *session.posargs)
    if shutil.which("valgrind"):  # instruction counts: steady where timings are noisy
        session.run("python", "benchmarks/count_instructions.py", "--stages", *session.posargs)
    else:
        session.log("benchmarks/count_instructions.py skipped: it needs valgrind")
    session.run("python", "benchmarks/bench_distributed.py", *session.posargs)
    session.run("python", "benchmarks/bench_ddp_step.py", "--compiled", *session.posargs)
    session.run("python", "benchmarks/bench_optim.py", *session.posargs, env=COMPILE_CACHE)
    session.run("python", "benchmarks/bench_zero.py", *session.posargs)
    session.run(
        "python", "benchmarks/bench_meanflow.py", "--compile", *session.posargs, env=COMPILE_CACHE
    )
    session.run("python", "benchmarks/zero_memory.py")
    session.run("python", "benchmarks/fsdp_memory.py", *session.posargs)
    session.run("python", "benchmarks/bench_pack_order.py", *session.posargs, env=COMPILE_CACHE)
