# Shared checks of the environment variables that size scripts/demo.sh and scripts/quality.sh;
# sourced, with PREFIX set to the script's name for the messages.
bad() { echo "$PREFIX: $1" >&2; exit 2; }
# every named variable unset, empty (its default) or a positive integer
check_positive_ints() {
  local var value
  for var in "$@"; do
    value=${!var:-}
    [[ -z $value || $value =~ ^[1-9][0-9]*$ ]] || bad "$var=$value: expected a positive integer"
  done
}
# $2 (the value of variable $1) is a positive number such as 1e-3
check_positive_number() {
  [[ $2 =~ ^([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?$ && ! $2 =~ ^[0.]+([eE].*)?$ ]] \
    || bad "$1=$2: expected a positive number such as 1e-3"
}
