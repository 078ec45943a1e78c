"""Every ```python block of README.md runs as written: in a fresh directory (the artifact of the embedded model ships in
the package), and, where a block talks to the server of `make run` (http://127.0.0.1:30000), against a real server on
a free port (the only change made to a block)."""

import contextlib
import io
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
MAKE_RUN_URL = "http://127.0.0.1:30000"
BLOCKS = [(README.read_text()[:m.start()].count("\n") + 1, m.group(1))
          for m in re.finditer(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)]
# the curl commands of ```bash blocks that talk to the server of `make run` (continued lines included)
CURLS = [cmd for m in re.finditer(r"^```bash\n(.*?)^```", README.read_text(), re.S | re.M)
         for cmd in re.findall(r"^curl (?:.*\\\n)*.*$", m.group(1), re.M) if MAKE_RUN_URL in cmd]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def server():
    from oscar_kv.server import BackgroundServer, ServeConfig

    # what `make run` serves (the INT2 cache with the artifact shipped for the embedded model), in a smaller pool
    srv = BackgroundServer(ServeConfig(kv_cache_memory=0.05, max_model_len=1024, port=0, log_level="warning")).start()
    yield srv
    srv.stop()


@pytest.fixture
def fresh_directory(tmp_path, monkeypatch):
    """Nothing from the checkout (no artifacts/ directory) a block could lean on."""
    monkeypatch.chdir(tmp_path)


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 2 and any(MAKE_RUN_URL in code for _, code in BLOCKS) and CURLS


@pytest.mark.parametrize("line,code", BLOCKS, ids=[f"README.md:{line}" for line, _ in BLOCKS])
def test_readme_python_block_runs(line, code, fresh_directory, request):
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


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl")
@pytest.mark.parametrize("command", CURLS)
def test_readme_curl_runs(command, server):
    out = subprocess.run(["bash", "-c", command.replace(MAKE_RUN_URL, server.url)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    assert answer["choices"][0]["message"]["content"] and answer["usage"]["completion_tokens"] >= 1, answer
