import { describe, expect, it } from 'vitest';
import { InvalidRequestError } from '../../core/errors.ts';
import { GREEDY_SAMPLING, resolveSamplingParams, type SamplingParams, validateSamplingParams } from './params.ts';

describe('sampling parameters', () => {
  it('accepts the defaults and typical values, filling omissions with greedy defaults', () => {
    expect(validateSamplingParams({ ...GREEDY_SAMPLING })).toEqual(GREEDY_SAMPLING);
    const p = resolveSamplingParams({ temperature: 0.7, topP: 0.9, seed: 2 ** 40 });
    expect(p).toEqual({ temperature: 0.7, topK: 0, topP: 0.9, minP: 0, repetitionPenalty: 1, seed: 2 ** 40 });
  });

  it.each<[keyof SamplingParams, number]>([
    ['temperature', -0.1],
    ['temperature', Number.POSITIVE_INFINITY],
    ['topK', -1],
    ['topK', 2.5],
    ['topP', 0],
    ['topP', 1.01],
    ['minP', -0.01],
    ['minP', 1.5],
    ['repetitionPenalty', 0],
    ['repetitionPenalty', -1],
    ['seed', 1.5],
    ['seed', Number.NaN],
  ])('rejects %s = %d with an InvalidRequestError naming it', (name, value) => {
    const attempt = () => validateSamplingParams({ ...GREEDY_SAMPLING, [name]: value });
    expect(attempt).toThrow(InvalidRequestError);
    expect(attempt).toThrow(new RegExp(`${name} = .* is out of range`));
  });
});
