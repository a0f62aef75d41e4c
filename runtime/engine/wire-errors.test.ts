/** Context-overflow advice names the real limit, and survives the worker boundary with its limit and message. */
import { describe, expect, it } from 'vitest';
import { type ContextLimit, ContextOverflowError } from '../../core/errors.ts';
import { fromWireError, toWireError } from './wire-errors.ts';

describe('ContextOverflowError', () => {
  const cases: Array<[ContextLimit, RegExp, RegExp | null]> = [
    [{ kind: 'model-context', contextLength: 512 }, /the model's context is 512 tokens/, /kvBudgetBytes|int2/],
    [{ kind: 'kv-budget', kv: 'f16' }, /fit the KV budget in the f16 KV mode.*raise kvBudgetBytes.*kv: 'int2'/, null],
    [{ kind: 'kv-budget', kv: 'int2' }, /fit the KV budget in the int2 KV mode.*raise kvBudgetBytes\.$/, /kv: 'int2'/],
    [{ kind: 'other', hint: 'Forking needs one free KV page.' }, /only 3 are available\. Forking needs/, null],
  ];

  it.each(cases)('%o: the message names that limit and only its remedies', (limit, says, never) => {
    const error = new ContextOverflowError(600, 3, limit);
    expect(error.message).toMatch(says);
    if (never) expect(error.message).not.toMatch(never);
    const back = fromWireError(structuredClone(toWireError(error))) as ContextOverflowError;
    expect(back).toBeInstanceOf(ContextOverflowError);
    expect(back.message).toBe(error.message);
    expect(back.limit).toEqual(limit);
    expect([back.tokensNeeded, back.tokensAvailable]).toEqual([600, 3]);
  });
});
