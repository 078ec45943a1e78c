"""Every ```python block of README.md runs as written: in a fresh directory holding the artifact `make run` writes,
and, where a block talks to the server of `make run` (http://127.0.0.1:30000), against a real server on a free
port (the only change made to a block)."""

import contextlib
import io
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
MAKE_RUN_URL = "http://127.0.0.1:30000"
BLOCKS = [(README.read_text()[:m.start()].count("\n") + 1, m.group(1))
          for m in re.finditer(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def server():
    from oscar_kv.server import BackgroundServer, ServeConfig

    srv = BackgroundServer(ServeConfig(kv_cache_dtype="bf16", kv_cache_memory=0.05, max_model_len=1024, port=0,
                                       log_level="warning")).start()
    yield srv
    srv.stop()


@pytest.fixture
def make_run_directory(smol, tmp_path, monkeypatch):
    """What `make run` leaves in the checkout: the rotations under .oscar-cache/artifacts/smollm2-135m (data-free
    here: the snippets' output depends on the artifact's shape, not its quality)."""
    from oscar_kv.artifacts import Rotations
    from oscar_kv.models import AttentionGeometry

    Rotations.data_free(AttentionGeometry.of(smol[0].config), "hadamard").save(
        tmp_path / ".oscar-cache/artifacts/smollm2-135m")
    monkeypatch.chdir(tmp_path)


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 2 and any(MAKE_RUN_URL in code for _, code in BLOCKS)


@pytest.mark.parametrize("line,code", BLOCKS, ids=[f"README.md:{line}" for line, _ in BLOCKS])
def test_readme_python_block_runs(line, code, make_run_directory, request):
    if MAKE_RUN_URL in code:
        code = code.replace(MAKE_RUN_URL, request.getfixturevalue("server").url)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"README.md:{line}", "exec"), {"__name__": "__main__"})
    printed = out.getvalue()
    print(printed)
    assert printed.strip(), "the block prints nothing"
    bits = re.search(r"([\d.]+) bits/element", printed)
    if bits:  # the INT2 history is in play, not only the BF16 windows
        assert float(bits.group(1)) < 12
