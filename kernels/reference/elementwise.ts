/** CPU references for kernels/elementwise.wgsl. */
export function swigluReference(gate: Float32Array, up: Float32Array): Float32Array {
  return gate.map((g, i) => (g / (1 + Math.exp(-g))) * up[i]);
}

export function addReference(x: Float32Array, y: Float32Array): Float32Array {
  return x.map((v, i) => v + y[i]);
}
