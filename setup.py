"""pdv_ext: heterogeneity-aware pipeline + data parallelism for DeepSpeed and Horovod."""
import glob
import os

from setuptools import find_packages, setup

setup(
    name="pdv_ext",
    version="0.1.0",
    description="Aggregation ops, hardware-aware stage placement and adaptive policies for DeepSpeed and Horovod",
    long_description=open("README.md", encoding="utf-8").read() if os.path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["pdv_ext", "pdv_ext.*"]),
    package_data={"pdv_ext": ["data/*.json", "data/*.md", "py.typed"]},
    # the C++ sources of the fused ops, JIT-built at first use (pdv_ext/kernels/cpu.py finds them here)
    data_files=[("share/pdv_ext/kernels", sorted(glob.glob("kernels/*.cpp")))],
    install_requires=["torch", "deepspeed", "pyyaml", "pydantic>=2", "numpy"],
    extras_require={
        "horovod": ["horovod[pytorch]>=0.28"],
        "mpi": ["mpi4py"],
        "plot": ["matplotlib"],
        "dev": ["pytest", "pytest-timeout", "scikit-learn", "matplotlib", "tqdm", "mkdocs"],
    },
    entry_points={
        "console_scripts": ["pdv=pdv_ext.cli:main"],
    },
)
