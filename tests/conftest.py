"""Shared fixtures: where the real parallel data lives, and a clean CLI runner."""

from __future__ import annotations

import contextlib
import getpass
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers.cli import NMT_CLI, NmtCli

# torch's inductor caches compiled kernels on disk without keying them by
# ATEN_CPU_CAPABILITY: a kernel compiled in a run capped at AVX2 and loaded by an uncapped
# one crashed it ("double free or corruption"), and the reverse computed wrong results (torch
# 2.13.0, test_projected_loss's compiled test). A capped run (`make test`'s second pass)
# therefore compiles into a cache of its own.
_CAPABILITY = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
if _CAPABILITY and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{_CAPABILITY}")

import torch  # noqa: E402  (after the cache directory is chosen)

REPO = Path(__file__).resolve().parents[1]
# Real data sits beside the project, never inside it (see ../shared/data/README.md).
SHARED_DATA = Path(os.environ.get("NMT_SHARED_DATA", REPO.parent / "shared" / "data"))


def shared_data_path(*parts: str) -> Path:
    """Path under ../shared/data, skipping the calling test with a reason if it is absent."""
    path = SHARED_DATA.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"real data not found at {path} (expected ../shared/data beside the repo; "
                    "set NMT_SHARED_DATA to its location)")
    return path


@pytest.fixture
def multi30k_dir() -> Path:
    """../shared/data/multi30k: train/val/test_2016_flickr .en/.de, untokenized."""
    return shared_data_path("multi30k")


@pytest.fixture
def wmt14_dir() -> Path:
    """../shared/data/wmt14: newstest2013/2014 plain text and the 2014 SGML."""
    return shared_data_path("wmt14")


@pytest.fixture(scope="session")
def nmt_cli() -> NmtCli:
    """The `nmt` CLI, one runner (tests/helpers/cli.py): `nmt_cli.run(*args)` in a subprocess
    (signals, real pipes, torchrun), `nmt_cli.invoke(*args)` in process through typer's
    CliRunner (bad flags, usage errors), `nmt_cli.popen(*args)`; keywords env, input, cwd."""
    return NMT_CLI


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to `n` inside the block, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def one_thread():
    """Run a test with one torch thread (its subprocesses run with one too, and on a small
    shared CPU two contending threads are many times slower than one)."""
    with torch_threads(1):
        yield


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-init checkpoint with a real Multi30k BPE vocabulary
    (tests/helpers/checkpoints.py), made once per session: for tests of the translation
    plumbing that need a loadable model, not a good one."""
    from helpers.checkpoints import make_checkpoint, make_vocab

    work = tmp_path_factory.mktemp("tiny-checkpoint")
    return make_checkpoint(make_vocab(shared_data_path("multi30k"), work), work / "model.pt")


def once_per_session(tmp_path_factory: pytest.TempPathFactory, name: str,
                     make: Callable[[Path], Path]) -> Path:
    """`make(directory)` run once per test session, also when pytest-xdist's workers (`make
    test`: two) each ask: the first builds it under the session's shared temp root while
    holding a lock, the others wait and take its result. For the fixtures that cost a
    minute or more to build."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return make(tmp_path_factory.mktemp(name))
    import fcntl

    root = tmp_path_factory.getbasetemp().parent / name  # popen-gwN's parent: this session
    root.mkdir(exist_ok=True)
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        done = root / "result"
        if done.is_file():
            return Path(done.read_text(encoding="utf-8"))
        result = make(root / "work")
        done.write_text(str(result), encoding="utf-8")
        return result


@pytest.fixture(scope="session")
def multi30k_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model trained briefly on Multi30k (a real, if weak, translation model),
    trained once per session (and once for all workers) for the exporters' tests."""
    shared_data_path("multi30k")  # skips here, in the test's own process, when absent
    return once_per_session(tmp_path_factory, "multi30k-model", _train_multi30k_model)


def _train_multi30k_model(work: Path) -> Path:
    from helpers.data import train_one_thread, write_text_data

    from nmt.config import TrainConfig, model_preset

    base = shared_data_path("multi30k")
    work.mkdir(parents=True, exist_ok=True)
    en = (base / "train.en").read_text(encoding="utf-8").splitlines()[:12000]
    de = (base / "train.de").read_text(encoding="utf-8").splitlines()[:12000]
    data = write_text_data(work / "data", {"train": list(zip(en, de, strict=True)),
                                           "valid": list(zip(en[:50], de[:50], strict=True))},
                           vocab_size=1000)
    cfg = TrainConfig(max_updates=600, max_tokens=2048, warmup=150, lr_scale=2.0,
                      max_len=64, log_interval=100, valid_interval=10_000,
                      save_interval_minutes=0, seed=1)
    return train_one_thread(data, work / "run", model_preset("tiny", dropout=0.1), cfg)


# --- The fast loop (`pytest -m "not slow"`) -----------------------------------------------
# Cost is marked from fixtures, at collection: every test that uses one of these (directly
# or through another fixture) is `slow`, so a new test on an expensive fixture is marked
# without anyone remembering to. Name -> what makes it expensive.
SLOW_FIXTURES: dict[str, str] = {
    "multi30k_model": "trains a small model on Multi30k for minutes (export tests)",
}
# A test outside `slow` that takes longer than this (setup + call, seconds) is named at
# the end of the run: mark it slow (keeping a fast test in its module) or make it cheaper.
FAST_BUDGET_S = 5.0
_costs: dict[str, float] = {}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark `slow` every test whose fixture closure holds a SLOW_FIXTURES entry."""
    for item in items:
        if SLOW_FIXTURES.keys() & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Add up each test's setup and call time (its cost in the fast loop)."""
    if report.when in ("setup", "call"):
        _costs[report.nodeid] = _costs.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int,
                            config: pytest.Config) -> None:
    """In a run that leaves `slow` out, name the tests over FAST_BUDGET_S."""
    if "not slow" not in (config.option.markexpr or ""):
        return
    over = sorted(((cost, nodeid) for nodeid, cost in _costs.items()
                   if cost > FAST_BUDGET_S), reverse=True)
    if over:
        terminalreporter.write_line(
            f"fast loop: {len(over)} test(s) over {FAST_BUDGET_S:.0f} s without the slow "
            "mark (mark them slow, keeping a fast test in their module, or make them "
            "cheaper): " + ", ".join(f"{nodeid} {cost:.1f} s" for cost, nodeid in over))
