/** Deterministic random data for kernel tests (mulberry32): failures reproduce from the seed. */
export function seededRandom(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

/** Uniform values in [-scale, scale), never all zero. */
export function randomFloats(random: () => number, count: number, scale = 1): Float32Array<ArrayBuffer> {
  const out = new Float32Array(count);
  for (let i = 0; i < count; i++) out[i] = (random() * 2 - 1) * scale;
  return out;
}

/** Largest |a-b| / (atol + rtol*|b|) over the arrays; <= 1 means within tolerance. */
export function maxToleranceRatio(
  actual: ArrayLike<number>,
  expected: ArrayLike<number>,
  atol: number,
  rtol: number,
): number {
  if (actual.length !== expected.length) throw new Error(`length ${actual.length} != ${expected.length}`);
  let worst = 0;
  for (let i = 0; i < actual.length; i++) {
    const r = Math.abs(actual[i] - expected[i]) / (atol + rtol * Math.abs(expected[i]));
    if (!(r <= worst)) worst = Number.isNaN(r) ? Number.POSITIVE_INFINITY : r;
  }
  return worst;
}

/**
 * `values` (rows of `width`) made into data with ties, in place: rounded to a grid of 1/4, a third of the rows
 * without negative values and a third without positive ones (every group's minimum, or maximum, is a zero), zeros
 * of both signs. A demotion's choice among equal extremes (−0 against +0) then shows in its f16 parameters, which
 * random floats never exercise.
 */
export function withTies(values: Float32Array, width: number): void {
  for (let i = 0; i < values.length; i++) {
    const row = Math.floor(i / width);
    let x = Math.round(4 * values[i]) / 4;
    if (row % 3 === 1) x = Math.abs(x);
    if (row % 3 === 2) x = -Math.abs(x);
    if (x === 0) x = i % 2 === 1 ? -0 : 0;
    values[i] = x;
  }
}
