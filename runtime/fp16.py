"""FP16 versions of the file's dense graphs, made at load for ONNX Runtime's CUDA provider, whose
GroupQueryAttention has no FP32 kernel (and FP16 is Turing's fast path).

Every FLOAT value becomes FLOAT16: inputs and outputs, Cast targets, constants, and the graph's
FLOAT weights (norm gains, biases, FP32 scales), which the runtime binds as FP16 copies. Inputs
and outputs named in `keep_f32` stay FLOAT at the graph's edge, converted inside: the FFN input
and output that pinfer's own kernels exchange in FP32, and the logits the sampler reads.
"""

import numpy as np
from onnx import TensorProto, helper, numpy_helper

F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16


def to_fp16(model, keep_f32=()):
    """Convert the ModelProto in place; returns the names of external FLOAT initializers that must
    be bound as FP16 copies."""
    g = model.graph
    keep = set(keep_f32)
    rename = {}
    edge_nodes = []
    for vi in g.input:
        t = vi.type.tensor_type
        if t.elem_type == F32:
            if vi.name in keep:
                inner = f"{vi.name}__f16"
                rename[vi.name] = inner
                edge_nodes.append(helper.make_node("Cast", [vi.name], [inner], to=F16))
            else:
                t.elem_type = F16
    for node in g.node:
        node.input[:] = [rename.get(i, i) for i in node.input]
        if node.op_type == "Cast":
            for a in node.attribute:
                if a.name == "to" and a.i == F32:
                    a.i = F16
    tail = []
    for vi in g.output:
        t = vi.type.tensor_type
        if t.elem_type == F32:
            if vi.name in keep:
                inner = f"{vi.name}__f16"
                for node in g.node:
                    node.output[:] = [inner if o == vi.name else o for o in node.output]
                tail.append(helper.make_node("Cast", [inner], [vi.name], to=F32))
            else:
                t.elem_type = F16
    nodes = edge_nodes + list(g.node) + tail
    del g.node[:]
    g.node.extend(nodes)
    external = []
    for init in g.initializer:
        if init.data_type != F32:
            continue
        if init.data_location == TensorProto.EXTERNAL:
            init.data_type = F16
            for entry in init.external_data:
                if entry.key == "length":
                    entry.value = str(int(entry.value) // 2)
            external.append(init.name)
        else:
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float16), init.name))
    del g.value_info[:]
    return external
