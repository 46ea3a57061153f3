# Sourced by vllm_env.sh and llamacpp_env.sh: a peer engine's own virtual environment.
#   peer_env DIR WHAT NOTE MODULE INSTALL
# makes (once) a virtual environment at DIR from $PYTHON (default python3), runs the function
# INSTALL with its python, checks that MODULE imports, marks DIR complete, and prints its python
# on the last line. A complete environment is reused; an incomplete one is built anew.
peer_env() {
  local dir=$1 what=$2 note=$3 module=$4 install=$5
  if [ ! -f "$dir/.eagle-complete" ]; then
    echo "$what: building $dir ($note)" >&2
    rm -rf "$dir"
    "${PYTHON:-python3}" -m venv "$dir"
    "$install" "$dir/bin/python"
    "$dir/bin/python" -c "import $module" >/dev/null
    touch "$dir/.eagle-complete"
  fi
  echo "$dir/bin/python"
}
