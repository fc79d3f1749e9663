"""Builds pinfer's CPU kernels (pinfer/kernels/csrc) as part of `pip install`; metadata is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "pinfer.kernels._kernels",
            sources=["pinfer/kernels/csrc/ffn_down.c", "pinfer/kernels/csrc/ffn_sparse.c",
                     "pinfer/kernels/csrc/decode.c", "pinfer/kernels/csrc/pool.c", "pinfer/kernels/csrc/quants.c",
                     "pinfer/kernels/csrc/x86/avx2.c", "pinfer/kernels/csrc/x86/avx512.c"],
            depends=["pinfer/kernels/csrc/half.h", "pinfer/kernels/csrc/pool.h", "pinfer/kernels/csrc/quants.h",
                     "pinfer/kernels/csrc/codes.h", "pinfer/kernels/csrc/x86/avx2.h"],
            extra_compile_args=["-O3", "-pthread", "-std=c11", "-fno-math-errno", "-ffp-contract=off"],
            extra_link_args=["-pthread"],
        )
    ]
)
