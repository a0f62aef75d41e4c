/**
 * `response_format` end to end on the demo model (lavapipe in CI): the GPU sampler draws under the grammar engine's
 * mask each step, and what comes back parses and meets its schema (checked by Ajv, not by the engine's own code),
 * streamed and not, greedy and sampled. Bad formats fail typed, and the engine answers the next request.
 */
import Ajv from 'ajv';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { withTestGpu } from '../../test/gpu.ts';
import type { ChatCompletionChunk, CompletionRequest, LongtabEngine } from './api.ts';
import { createNodeEngine } from './node.ts';

const ctx = withTestGpu();
const DEMO = 'public/models/longtab-demo.gguf';

const PERSON = {
  type: 'object',
  properties: {
    name: { type: 'string', maxLength: 24 },
    age: { type: 'integer', minimum: 0, maximum: 120 },
    tribe: { enum: ['Judah', 'Levi', 'Benjamin'] },
  },
  required: ['name', 'age', 'tribe'],
  additionalProperties: false,
};

describe('response_format on the demo model', () => {
  let engine: LongtabEngine;
  const ajv = new Ajv({ strict: false });

  beforeAll(async () => {
    engine = createNodeEngine({ gpu: ctx.gpu });
    await engine.load(DEMO, { kv: 'f16', kvBudgetBytes: 8 << 20 });
  }, 120_000);
  afterAll(() => engine?.destroy());

  const complete = (request: Partial<CompletionRequest>) =>
    engine.completions.create({ prompt: 'And the LORD said unto Moses,', max_tokens: 96, ...request, stream: false });

  it('json_schema: greedy and sampled replies parse and meet the schema; the reply ends when the object does', async () => {
    for (const sampling of [
      { temperature: 0 },
      { temperature: 0.9, seed: 3 },
      { temperature: 1.2, top_k: 40, seed: 8 },
    ]) {
      const reply = await complete({
        ...sampling,
        response_format: { type: 'json_schema', json_schema: { name: 'person', schema: PERSON } },
      });
      const choice = reply.choices[0];
      expect(choice.finish_reason, choice.text).toBe('stop');
      const value = JSON.parse(choice.text);
      expect(ajv.validate(PERSON, value), choice.text).toBe(true);
    }
  }, 120_000);

  it('streamed chat with json_object: the chunks join to one JSON object; a grammar constrains the text', async () => {
    const stream = await engine.chat.completions.create({
      messages: [{ role: 'user', content: 'Describe the ark as JSON.' }],
      max_tokens: 64,
      temperature: 0.7,
      seed: 5,
      stream: true,
      response_format: { type: 'json_object' },
    });
    const chunks: ChatCompletionChunk[] = [];
    for await (const chunk of stream) chunks.push(chunk);
    const text = chunks.map((c) => c.choices[0].delta.content ?? '').join('');
    const finish = chunks.at(-1)!.choices[0].finish_reason;
    // An object can outgrow 64 tokens ('length'); when it ends in time it is one JSON object.
    if (finish === 'stop') expect(typeof JSON.parse(text)).toBe('object');
    else expect(finish).toBe('length');
    expect(text.startsWith('{'), text).toBe(true);

    const verdict = await complete({
      temperature: 1,
      seed: 11,
      response_format: { type: 'grammar', grammar: 'root ::= "The answer is " ("yes" | "no") "."' },
    });
    expect(verdict.choices[0].text).toMatch(/^The answer is (yes|no)\.$/);
    expect(verdict.choices[0].finish_reason).toBe('stop');
  }, 120_000);

  it('a bad format fails typed and names the field; the next request is answered', async () => {
    await expect(complete({ response_format: { type: 'grammar', grammar: 'root ::= ( "a"' } })).rejects.toMatchObject({
      code: 'invalid-request',
      details: { field: 'response_format.grammar' },
    });
    await expect(
      complete({ response_format: { type: 'json_schema', json_schema: { name: 'bad name!', schema: PERSON } } }),
    ).rejects.toMatchObject({ code: 'invalid-request', details: { field: 'response_format.json_schema.name' } });
    await expect(complete({ response_format: { type: 'xml' } as never })).rejects.toMatchObject({
      code: 'invalid-request',
      details: { field: 'response_format.type' },
    });
    const plain = await complete({ temperature: 0, max_tokens: 8 });
    expect(plain.choices[0].text.length).toBeGreaterThan(0);
  }, 120_000);
});
