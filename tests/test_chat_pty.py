"""`pinfer chat` driven through a pseudo-terminal, as a person would use it."""

import sys

import pexpect
import pytest
from fixtures import make_tiny_llama_gguf

from pinfer.converter.passes import DENSE
from pinfer.converter.convert import ConvertOptions, convert


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    import contextlib
    import io

    d = tmp_path_factory.mktemp("pty")
    src = make_tiny_llama_gguf(d / "tiny.gguf", qtype="F16")
    with contextlib.redirect_stderr(io.StringIO()):
        return convert(ConvertOptions(src, d / "tiny.pinf", passes=DENSE))


def test_chat_keeps_answering_when_the_context_overflows(tiny):
    child = pexpect.spawn(sys.executable, ["-m", "pinfer", "chat", str(tiny), "-c", "128", "-n", "6", "--temp", "0",
                                           "-t", "1"], encoding="utf-8", timeout=60)
    child.expect("> ")
    notices = 0
    for i in range(6):
        child.sendline(f"message {i}: the quick brown fox jumps over the dog")
        idx = child.expect([r"\[context full: dropped", "> "])
        if idx == 0:
            notices += 1
            child.expect("> ")
    assert notices >= 1
    child.sendline("x" * 400)                # larger than the whole context: an error, not a crash
    child.expect(r"more than the context")
    child.expect("> ")
    child.sendline('"""')                    # a multi-line message still gets a reply
    child.sendline("first line")
    child.sendline("second line")
    child.sendline('"""')
    child.expect("> ")
    child.sendline("/stats")
    child.expect("reply")
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
