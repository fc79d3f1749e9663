"""How the `.pinf`'s weights become ONNX operators: a small graph builder whose initializers are
placeholders for tensors of the file (external data at schema.EXTERNAL_LOCATION, bound by the
runtime to views of the memory map), and `linear`, the one translation of a block-format weight
into ONNX Runtime ops. The runtime builds every graph it runs with it (runtime/graphs.py and its
MatMulNBits down projection). Formats:
  q4  -> MatMulNBits(bits=4) (default zero point 8), plus sum_blocks(x) @ (min + 8*scale)^T when
         the weight has a min (GGUF Q4_1); the extra term is exact and reads K/32 values per row;
  q5  -> MatMulNBits(bits=8) with zero point 16 over the 5-bit values, which a few integer ops
         rebuild from the nibble and fifth-bit planes; their inputs are all initializers, so ONNX
         Runtime folds them once when the session is made (memory then holds a byte per weight, as
         q8 does; the file keeps 5.5 bits); a min adds the term q4's does (min + 16*scale);
  q8  -> MatMulNBits(bits=8) (default zero point 128: .pinf stores q8 offset by 128);
  f16/f32 -> MatMul with the transposed weight (f16 cast to f32; both folded at session load).
"""

import math

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from . import schema as S

OPSETS = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
IR_VERSION = 10  # onnxruntime 1.2x/1.3x accept up to 10-13; onnx 1.23 writes 14 by default
F32 = TensorProto.FLOAT
ACCURACY_LEVEL = 4  # MatMulNBits quantizes activations to int8 per block, as llama.cpp does

_ONNX_DTYPE = {"u8": TensorProto.UINT8, "i8": TensorProto.INT8, "f16": TensorProto.FLOAT16,
               "f32": TensorProto.FLOAT, "i32": TensorProto.INT32}


class GraphBuilder:
    def __init__(self, name, directory):
        self.name = name
        self.directory = directory   # tensor name -> {"dtype", "shape", ...} of the .pinf
        self.nodes, self.inits, self.inputs, self.outputs = [], [], [], []
        self._bound = set()
        self._n = 0

    def tmp(self, hint):
        self._n += 1
        return f"{hint}_{self._n}"

    def node(self, op, inputs, n_out=1, domain="", **attrs):
        outs = [self.tmp(op.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op, inputs, outs, domain=domain, **attrs))
        return outs[0] if n_out == 1 else outs

    def weight(self, name):
        """A placeholder initializer for the .pinf tensor `name`."""
        if name not in self._bound:
            e = self.directory[name]
            t = TensorProto(name=name, data_type=_ONNX_DTYPE[e["dtype"]], dims=e["shape"])
            t.data_location = TensorProto.EXTERNAL
            for key, value in (("location", S.EXTERNAL_LOCATION), ("offset", "0"), ("length", str(e["nbytes"]))):
                entry = t.external_data.add()
                entry.key, entry.value = key, value
            self.inits.append(t)
            self._bound.add(name)
        return name

    def const(self, array, hint="c"):
        name = self.tmp(hint)
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def input(self, name, elem, shape):
        self.inputs.append(helper.make_tensor_value_info(name, elem, shape))
        return name

    def output(self, value, name, elem, shape):
        self.nodes.append(helper.make_node("Identity", [value], [name]))
        self.outputs.append(helper.make_tensor_value_info(name, elem, shape))

    def f32(self, name):
        e = self.directory[name]
        return self.weight(name) if e["dtype"] == "f32" else self.node("Cast", [self.weight(name)], to=F32)

    def linear(self, x, base, fmt, rows, k):
        """x (1, S, k) @ W^T for the block-format weight `base` of shape (rows, k) -> (1, S, rows).
        Raises ValueError when the file's parts of `base` do not hold a (rows, k) weight in `fmt`:
        the graph reshapes them, so a part of another size must never reach ONNX Runtime."""
        part = lambda p: S.part_name(base, p)  # noqa: E731
        self.check_parts(base, fmt, rows, k)
        if fmt in ("f16", "f32"):
            w = self.node("Reshape", [self.f32(part("w")), self.const(np.array([rows, k]))])
            return self.node("MatMul", [x, self.node("Transpose", [w], perm=[1, 0])])
        bits = {"q4": 4, "q5": 8, "q8": 8}[fmt]
        nb = k // S.GROUP
        if fmt == "q5":
            q = self._q5_values(part("q"), part("qh"), rows, nb)
        else:
            q = self.node("Reshape", [self.weight(part("q")), self.const(np.array([rows, nb, S.GROUP * bits // 8]))])
        scale = self.node("Reshape", [self.f32(part("scale")), self.const(np.array([rows, nb]))])
        inputs = [x, q, scale]
        if fmt == "q5":     # zero point 16 for every block
            inputs.append(self.node("Expand", [self.const(np.uint8(S.NO_MIN_OFFSET["q5"])), self.const(np.array([rows, nb]))]))
        y = self.node("MatMulNBits", inputs, domain="com.microsoft",
                      K=k, N=rows, bits=bits, block_size=S.GROUP, accuracy_level=ACCURACY_LEVEL)
        if fmt in ("q4", "q5") and part("min") in self.directory:
            # value = scale*q + min = scale*(q - z) + (min + z*scale), z the zero point (8, or 16)
            z = np.float32(S.NO_MIN_OFFSET[fmt])
            mins = self.node("Reshape", [self.f32(part("min")), self.const(np.array([rows, nb]))])
            offset = self.node("Add", [mins, self.node("Mul", [scale, self.const(z)])])
            sums = self.node("ReduceSum", [self.node("Reshape", [x, self.const(np.array([1, -1, nb, S.GROUP]))]),
                                           self.const(np.array([-1]))], keepdims=0)
            y = self.node("Add", [y, self.node("MatMul", [sums, self.node("Transpose", [offset], perm=[1, 0])])])
        return y

    def check_parts(self, base, fmt, rows, k):
        if fmt not in S.BLOCK_FORMATS or k % S.GROUP:
            raise ValueError(f"the weight {base!r} is in format {fmt!r}, which a ({rows}, {k}) matrix cannot use")
        for p, (dtype, shape) in S.block_parts(fmt, rows, k).items():
            e = self.directory.get(S.part_name(base, p))
            if e is None and p in S.OPTIONAL_PARTS:
                continue
            if e is None or e["dtype"] != dtype or math.prod(e["shape"]) != math.prod(shape):
                found = "missing" if e is None else f"{e['dtype']} {e['shape']}"
                raise ValueError(f"the weight {S.part_name(base, p)!r} is {found}; a ({rows}, {k}) {fmt} "
                                 f"weight needs {dtype} {list(shape)}")

    def _q5_values(self, q, qh, rows, nb):
        """(rows, nb, 32) uint8 5-bit values of a q5 weight from its planes (schema: q the low nibbles
        as q4, qh per group the even elements' fifth bits as a u16, then the odd ones')."""
        u8 = lambda v: self.const(np.uint8(v))  # noqa: E731
        last = self.const(np.array([-1]))
        pair = [self.node("Unsqueeze", [self.node("BitwiseAnd", [self.weight(q), u8(15)]), last]),
                self.node("Unsqueeze", [self.node("BitShift", [self.weight(q), u8(4)], direction="RIGHT"), last])]
        low = self.node("Reshape", [self.node("Concat", pair, axis=-1), self.const(np.array([rows, nb, S.GROUP]))])
        bits = self.node("BitwiseAnd", [self.node("BitShift", [
            self.node("Reshape", [self.weight(qh), self.const(np.array([rows, nb, 4, 1]))]),
            self.const(np.arange(8, dtype=np.uint8))], direction="RIGHT"), u8(1)])         # (rows, nb, 4, 8)
        planes = self.node("Reshape", [bits, self.const(np.array([rows, nb, 2, S.GROUP // 2]))])
        high = self.node("Reshape", [self.node("Transpose", [planes], perm=[0, 1, 3, 2]),
                                     self.const(np.array([rows, nb, S.GROUP]))])
        return self.node("BitwiseOr", [low, self.node("BitShift", [high, u8(4)], direction="LEFT")])

    def build(self):
        g = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, initializer=self.inits)
        m = helper.make_model(g, opset_imports=OPSETS, producer_name="pinfer")
        m.ir_version = IR_VERSION
        return m
