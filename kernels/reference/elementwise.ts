/** CPU references for kernels/elementwise.wgsl. */
export function swigluReference(gate: Float32Array, up: Float32Array): Float32Array {
  return gate.map((g, i) => (g / (1 + Math.exp(-g))) * up[i]);
}

/** gelu(g)·u with gelu's tanh approximation, as written (f64). */
export function gegluReference(gate: Float32Array, up: Float32Array): Float32Array {
  return gate.map((g, i) => 0.5 * g * (1 + Math.tanh(Math.sqrt(2 / Math.PI) * (g + 0.044715 * g ** 3))) * up[i]);
}

export function addReference(x: Float32Array, y: Float32Array): Float32Array {
  return x.map((v, i) => v + y[i]);
}
