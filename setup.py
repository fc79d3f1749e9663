"""Builds pinfer's CPU kernels (kernels/csrc) as part of `pip install`; metadata is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "pinfer.kernels._kernels",
            sources=["kernels/csrc/ffn_down.c"],
            extra_compile_args=["-O3", "-fopenmp", "-std=c11"],
            extra_link_args=["-fopenmp"],
        )
    ]
)
