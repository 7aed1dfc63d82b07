# Sourced by the device scripts (run.sh, multi_gpu.sh, parallel.sh): `install_wheels` installs the
# wheels of each directory in $WHL_DIRS (default: .whl .whl_web, carried beside the tree; an absent
# one is skipped, so WHL_DIRS=none installs nothing) into .site, once per set of wheel files: a
# directory whose wheels changed since its last install (a wheel added) is installed again.
install_wheels() {
  mkdir -p .site
  local d stamp
  for d in ${WHL_DIRS:-.whl .whl_web}; do
    [ -d "$d" ] || continue
    stamp=$(ls "$d" | sort | cksum | cut -d' ' -f1)
    [ "$(cat ".site/.done-${d#.}" 2>/dev/null)" = "$stamp" ] && continue
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site "$d"/*.whl \
      && echo "$stamp" > ".site/.done-${d#.}" || return 1
  done
}
