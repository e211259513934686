source tools/remote_gpu/env.sh
mkdir -p /tmp/xfer && cp .xfer/p0 /tmp/xfer/ || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -c "import gguf, jax; print('gguf ok', jax.__version__, jax.devices())"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv; df -h /tmp | tail -1; nproc
