"""GLM-5-style distributed pretraining on megatron-core."""

from setuptools import find_packages, setup

setup(
    name="glm5-pretrain",
    version="0.1.0",
    description="Pretraining framework for GLM-5-style models (MLA, DSA, MoE, MTP, Muon) on megatron-core",
    python_requires=">=3.10",
    packages=find_packages(include=["pretrain", "pretrain.*", "parallel", "parallel.*", "data_pipeline", "data_pipeline.*"]),
    install_requires=[
        "megatron-core==0.16.1",  # the last release for Python 3.11; every workaround is in pretrain/compat/
        "torch>=2.6",
        "numpy",
        "omegaconf>=2.3",
        "pyyaml",
        "safetensors",
        "tokenizers",
        "tqdm",
        "rich",
    ],
    extras_require={
        "hf": ["transformers==5.23.0"],  # GlmMoeDsaForCausalLM, the reference model
        "wandb": ["wandb"],
        "parquet": ["pyarrow"],
        "plot": ["matplotlib"],  # the loss-curve PNGs (pretrain.ablate, pretrain.tools.plot); tables need nothing
        "tensorboard": ["tensorboard"],
        "te": ["transformer-engine[pytorch]"],  # optional backend, used when it imports
        # the DSA kernels; CUDA builds of torch ship it, the CPU tests run it in its interpreter
        "kernels": ["triton==3.6.0"],
        "liger": ["liger-kernel==0.8.5"],  # model.output_loss_backend=liger
        "deepspeed": ["deepspeed>=0.19"],  # model.activation_offload_backend=deepspeed
        "dev": ["pytest>=8", "pytest-timeout", "transformers==5.23.0", "matplotlib", "tensorboard", "triton==3.6.0",
                "pyarrow", "liger-kernel==0.8.5", "deepspeed>=0.19"],
    },
    entry_points={
        "console_scripts": [
            "glm5-convert=pretrain.convert.cli:main",
            "glm5-summary=pretrain.model.summary:main",
            "glm5-preprocess=data_pipeline.preprocess:main",
            "glm5-train-tokenizer=data_pipeline.train_tokenizer:main",
        ]
    },
)
