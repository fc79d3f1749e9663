"""pinfer's own GGUF header reader (converter/frontend/gguf_check.read_header) against gguf-py's
GGUFReader, the independent reference: the same metadata values and the same tensor bytes."""

import numpy as np
import pytest
from fixtures import make_tiny_llama_gguf
from gguf import GGUFReader, GGUFValueType

from pinfer.converter.frontend.gguf_check import read_header
from pinfer.converter.frontend.gguf_source import GGUFSource


def _reference_value(field):
    t = field.types[0]
    if t == GGUFValueType.ARRAY:
        if field.types[1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if t == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    return field.parts[field.data[0]].tolist()[0]


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q4_1", "Q8_0", "Q4_K"])
def test_header_and_tensors_equal_gguf_pys(tmp_path, qtype):
    kw = dict(d_model=256, n_ff=256) if qtype.endswith("_K") else {}
    path = make_tiny_llama_gguf(tmp_path / "t.gguf", qtype=qtype,
                                extra_kv={"test.flag": True, "test.scale": 0.125, "test.neg": -3,
                                          "test.floats": [0.5, -1.25, 3.0]}, **kw)
    ref = GGUFReader(path)
    want = {k: _reference_value(f) for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    h = read_header(path)
    assert h.meta == want
    assert {k: type(v) for k, v in h.meta.items()} == {k: type(v) for k, v in want.items()}
    src = GGUFSource(path)
    assert src.tensor_names() == {t.name for t in ref.tensors}
    for t in ref.tensors:
        got = src.tensor(t.name)
        assert got.ttype == t.tensor_type and got.raw.dtype == t.data.dtype
        assert np.array_equal(got.raw.reshape(-1).view(np.uint8), np.asarray(t.data).reshape(-1).view(np.uint8))
        assert src.nbytes(t.name) == t.data.nbytes and src.ttype(t.name) == t.tensor_type
