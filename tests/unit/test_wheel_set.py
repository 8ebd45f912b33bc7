"""`benchmarks/wheel_set.py`: one wheel per project (the newest) from a folder holding the sets
of several GPU benchmarks, so that pip's offline install on the GPU machine takes them at once."""

from __future__ import annotations

from benchmarks.wheel_set import newest_per_project


def test_one_wheel_per_project_the_newest():
    # GPU.md's megatron set and `unirl serve`'s set, as the GPU machine's .whl/ holds them
    wheels = [
        ".whl/megatron_core-0.16.1-cp312-cp312-manylinux_2_28_x86_64.whl",
        ".whl/pydantic-2.12.5-py3-none-any.whl",
        ".whl/pydantic-2.14.4-py3-none-any.whl",
        ".whl/pydantic_core-2.41.5-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
        ".whl/pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
        # one project spelled two ways (PEP 503 names it typing-extensions)
        ".whl/Typing.Extensions-4.15.0-py3-none-any.whl",
        ".whl/typing_extensions-4.16.0-py3-none-any.whl",
        # versions compare as versions: 0.10.0 is newer than 0.9.0 (not as strings)
        ".whl/hjson-0.9.0-py3-none-any.whl",
        ".whl/hjson-0.10.0-py3-none-any.whl",
    ]
    assert newest_per_project(wheels) == [
        ".whl/hjson-0.10.0-py3-none-any.whl",
        ".whl/megatron_core-0.16.1-cp312-cp312-manylinux_2_28_x86_64.whl",
        ".whl/pydantic-2.14.4-py3-none-any.whl",
        ".whl/pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
        ".whl/typing_extensions-4.16.0-py3-none-any.whl",
    ]
