# hf-memfit with everything a cloud GPU run needs: DeepSpeed, bitsandbytes (QLoRA), flash-attention.
#
#   docker build -t hf-memfit .
#   docker run --gpus all --ipc=host -v ~/.cache/huggingface:/root/.cache/huggingface -e HF_TOKEN \
#       hf-memfit accelerate launch recipes/gpt2xl_12gb.py
#
# The devel image (not runtime) because flash-attn and DeepSpeed's ops compile against nvcc
# and the CUDA headers. Its torch (2.9, CUDA 12.8) meets transformers 5's torch>=2.6.
FROM pytorch/pytorch:2.9.0-cuda12.8-cudnn9-devel

# MAX_JOBS: flash-attn builds from source when no prebuilt wheel matches; bound its parallel
# nvcc jobs, each of which can take several GB of RAM.
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 MAX_JOBS=4

WORKDIR /workspace/hf-memfit

# flash-attn and deepspeed import torch in their setup.py, so they are built with
# `--no-build-isolation` against the image's CUDA torch; that needs the build tools here first.
RUN pip install --upgrade pip setuptools wheel ninja packaging psutil

# What the install needs (pyproject names README.md), then what `docker run` uses.
COPY pyproject.toml README.md ./
COPY hf_memfit ./hf_memfit
COPY recipes ./recipes
COPY ds_configs ./ds_configs

# pip keeps the image's torch: every requirement accepts it.
RUN pip install --no-build-isolation ".[deepspeed,bnb,flash,recipes]"

# Optional: calibrate fast mode for the catalogue's generic families now, so the container's first plans
# start warm (`docker build --build-arg WARM_CACHE=1`). The cache is keyed by library versions, so it is
# built here, against the image's own torch and transformers.
ARG WARM_CACHE=0
ENV HF_MEMFIT_CACHE=/opt/hf_memfit
RUN if [ "$WARM_CACHE" = "1" ]; then hf-memfit cache warm; fi

# Offline and harmless: the plan for the first recipe. Pass a command to train instead.
CMD ["python", "recipes/gpt2xl_12gb.py", "--dry-run"]
