#!/usr/bin/env bash
# On the CPU machine, before a GPU session: put into .whl/ (git-ignored; name it in the device call's carry) the
# wheels the device machine lacks, for its Python 3.12: megatron-core 0.19.2 (scripts/gpu_env.sh installs it),
# DeepSpeed 0.19.8 and what it needs there (scripts/gpu_deepspeed.sh, scripts/gpu_user_paths.sh), PyYAML and tqdm
# (scripts/gpu_train.sh). DeepSpeed is published as a source archive only: it is built into a wheel here, with no
# ops (DS_BUILD_OPS=0, as the device runs use none). About 8 MB in all.
#   usage: bash scripts/fetch_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .whl \
    megatron-core==0.19.2 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 \
    hjson==3.1.0 typing-extensions==4.15.0 pyyaml==6.0.4 tqdm==4.70.1
DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps --no-build-isolation -w .whl deepspeed==0.19.8
ls -1 .whl
