/** How far two runs' logits (or any two equal-length arrays) are apart, for the KV-cache comparisons. */

export function maxAbsDiff(a: ArrayLike<number>, b: ArrayLike<number>): number {
  let worst = 0;
  for (let i = 0; i < a.length; i++) worst = Math.max(worst, Math.abs(a[i] - b[i]));
  return worst;
}

export function meanAbsDiff(a: ArrayLike<number>, b: ArrayLike<number>): number {
  let sum = 0;
  for (let i = 0; i < a.length; i++) sum += Math.abs(a[i] - b[i]);
  return sum / a.length;
}

/** The share of rows (of `vocab` logits each) whose argmax is the same in both. */
export function argmaxAgreement(a: Float32Array, b: Float32Array, vocab: number): number {
  let same = 0;
  const rows = a.length / vocab;
  for (let r = 0; r < rows; r++) {
    let ia = 0;
    let ib = 0;
    for (let i = 1; i < vocab; i++) {
      if (a[r * vocab + i] > a[r * vocab + ia]) ia = i;
      if (b[r * vocab + i] > b[r * vocab + ib]) ib = i;
    }
    if (ia === ib) same++;
  }
  return same / rows;
}
