import { InvalidRequestError } from '../../core/errors.ts';

/**
 * Per-request sampling parameters. The GPU sampler (kernels/sample.ts) applies them in llama.cpp's common-sampler
 * order: repetition penalty → top-k → top-p → min-p → temperature → draw. top-p and min-p see the penalized logits
 * at temperature 1 (as in llama.cpp, temperature only shapes the final draw); every logit equal to a threshold is
 * kept, so top-k can keep more than k ids when they tie.
 */
export interface SamplingParams {
  /** 0 = greedy argmax (ties → lowest id); otherwise the draw is from softmax(logits / temperature). */
  temperature: number;
  /** Keep the k highest logits; 0 = off. */
  topK: number;
  /** Keep the smallest top set whose probability mass reaches topP; 1 = off. */
  topP: number;
  /** Keep ids whose probability is at least minP × the top probability; 0 = off. */
  minP: number;
  /** llama.cpp repeat penalty over the recent history: logit > 0 → logit / penalty, else logit × penalty; 1 = off. */
  repetitionPenalty: number;
  /** Any safe integer; together with the decode step it fixes every draw. */
  seed: number;
}

export const GREEDY_SAMPLING: Readonly<SamplingParams> = {
  temperature: 0,
  topK: 0,
  topP: 1,
  minP: 0,
  repetitionPenalty: 1,
  seed: 0,
};

function fail(name: string, value: unknown, rule: string): never {
  throw new InvalidRequestError(`Sampling parameter ${name} = ${String(value)} is out of range: ${rule}.`, {
    parameter: name,
    value,
  });
}

/** Throws InvalidRequestError, naming the parameter and its allowed range, for any value the sampler cannot use. */
export function validateSamplingParams(p: SamplingParams): SamplingParams {
  const isNumber = (v: unknown): v is number => typeof v === 'number' && !Number.isNaN(v);
  if (!isNumber(p.temperature) || p.temperature < 0 || !Number.isFinite(p.temperature)) {
    fail('temperature', p.temperature, 'use a finite number >= 0 (0 = greedy)');
  }
  if (!isNumber(p.topK) || !Number.isInteger(p.topK) || p.topK < 0 || p.topK > 0xffffffff) {
    fail('topK', p.topK, 'use an integer >= 0 (0 = off)');
  }
  if (!isNumber(p.topP) || !(p.topP > 0 && p.topP <= 1)) fail('topP', p.topP, 'use a number in (0, 1] (1 = off)');
  if (!isNumber(p.minP) || !(p.minP >= 0 && p.minP <= 1)) fail('minP', p.minP, 'use a number in [0, 1] (0 = off)');
  if (!isNumber(p.repetitionPenalty) || !(p.repetitionPenalty > 0) || !Number.isFinite(p.repetitionPenalty)) {
    fail('repetitionPenalty', p.repetitionPenalty, 'use a finite number > 0 (1 = off)');
  }
  if (!isNumber(p.seed) || !Number.isSafeInteger(p.seed)) fail('seed', p.seed, 'use an integer');
  return p;
}

/** Fills the parameters a request left out with the greedy defaults, then validates the result. */
export function resolveSamplingParams(request: Partial<SamplingParams>): SamplingParams {
  const p = { ...GREEDY_SAMPLING };
  for (const key of Object.keys(p) as (keyof SamplingParams)[]) {
    if (request[key] !== undefined) p[key] = request[key];
  }
  return validateSamplingParams(p);
}
