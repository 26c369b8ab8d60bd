// Validates custom resources against their CRDs' OpenAPI schemas, as published in the
// @kubernetes-models npm packages (generated from each project's CRDs; deploy/tools/
// fetch-tools.sh installs them into .tools/npm). Reads a JSON array of documents on stdin,
// prints a JSON array with, per document, null (valid), "unknown" (no schema for its kind
// here) or the validation error's text.
import { existsSync } from "node:fs";
import { pathToFileURL } from "node:url";
import path from "node:path";

const root = path.join(process.env.EPP_NPM_MODULES, "node_modules");
const MODELS = {
  "gateway.networking.k8s.io/v1": "@kubernetes-models/gateway-api/gateway.networking.k8s.io/v1",
  "networking.istio.io/v1": "@kubernetes-models/istio/networking.istio.io/v1",
  "networking.istio.io/v1alpha3": "@kubernetes-models/istio/networking.istio.io/v1alpha3",
  "monitoring.coreos.com/v1": "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1",
  "gateway.envoyproxy.io/v1alpha1": "@kubernetes-models/envoy-gateway/gateway.envoyproxy.io/v1alpha1",
};

let input = "";
for await (const chunk of process.stdin) input += chunk;
const out = [];
for (const doc of JSON.parse(input)) {
  const base = MODELS[doc.apiVersion];
  const file = base && path.join(root, base, `${doc.kind}.js`);
  if (!file || !/^[A-Za-z]+$/.test(doc.kind) || !existsSync(file)) {
    out.push("unknown");
    continue;
  }
  const mod = await import(pathToFileURL(file).href);
  const Model = mod[doc.kind] ?? mod.default;
  try {
    new Model(doc).validate();
    out.push(null);
  } catch (err) {
    out.push(String(err && err.message ? err.message : err));
  }
}
process.stdout.write(JSON.stringify(out));
