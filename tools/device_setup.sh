# Sourced at the start of each device call: install the carried wheels and
# build the C extension in place. Usage: . tools/device_setup.sh
# .whl/ holds numpy_allocator and setuptools>=77 (pyproject.toml's license is
# a PEP 639 expression, which older setuptools refuse), downloaded with the
# pip command of the device's README.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site:$PWD
export CUPY_ENABLE_UMP=1 PYTHONUNBUFFERED=1
python3 setup.py -q build_ext --inplace >/dev/null 2>&1 || python3 setup.py build_ext --inplace || return 1
# The device's image sets PYTHONDONTWRITEBYTECODE=1: without this every
# process compiled ump's modules anew (~40 ms of each python -m ump run),
# which an installed wheel never does.
python3 -m compileall -q ump
