/**
 * `response_format` end to end on the demo model (lavapipe in CI): the GPU sampler draws under the grammar engine's
 * mask each step, and what comes back parses and meets its schema (checked by Ajv, not by the engine's own code),
 * streamed and not, greedy and sampled. Bad formats fail typed, and the engine answers the next request.
 */
import Ajv from 'ajv';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { GgmlType } from '../../core/gguf-types.ts';
import { withTestGpu } from '../../test/gpu.ts';
import { seededRandom } from '../../test/random.ts';
import { randomSchema } from '../../test/random-schema.ts';
import { modelFixtureGguf } from '../../tools/fixtures/model-fixtures.ts';
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

/**
 * Property test: random schemas decoded end to end by the GPU sampler under the grammar engine's mask, on the demo
 * model and on a random-weight model (whose logits favour nothing the grammar wants): every reply that ends parses,
 * and Ajv accepts it; any other ends for want of tokens (finish 'length').
 */
describe.each<[string, () => Blob | string]>([
  ['the demo model', () => DEMO],
  [
    'a random-weight model',
    () =>
      new Blob([
        modelFixtureGguf({
          architecture: 'llama',
          weightType: GgmlType.F32,
          dim: 128,
          layers: 2,
          heads: 2,
          kvHeads: 2,
          headDim: 64,
          ffnDim: 256,
          vocab: 300,
          tiedOutput: true,
          ropeFreqBase: 10000,
          llama3RopeFreqs: false,
          seed: 19,
          contextLength: 512,
        }),
      ]),
  ],
])('random JSON schemas on %s', (_, model) => {
  let engine: LongtabEngine;
  const ajv = new Ajv({ strict: false });

  beforeAll(async () => {
    engine = createNodeEngine({ gpu: ctx.gpu });
    await engine.load(model(), { kv: 'f16', kvBudgetBytes: 8 << 20 });
  }, 120_000);
  afterAll(() => engine?.destroy());

  it('every reply that ends parses and meets its schema (Ajv), streamed or not', async () => {
    const random = seededRandom(23);
    let ended = 0;
    const trials = 8;
    for (let trial = 0; trial < trials; trial++) {
      const schema = randomSchema(random);
      const request = {
        prompt: 'Once upon a time',
        max_tokens: 160,
        temperature: 1,
        seed: trial,
        response_format: { type: 'json_schema' as const, json_schema: { name: `s${trial}`, schema } },
      };
      let text: string;
      let finish: string | null;
      if (trial % 2 === 0) {
        const reply = await engine.completions.create({ ...request, stream: false });
        text = reply.choices[0].text;
        finish = reply.choices[0].finish_reason;
      } else {
        text = '';
        finish = null;
        for await (const chunk of await engine.completions.create({ ...request, stream: true })) {
          text += chunk.choices[0]?.text ?? '';
          finish = chunk.choices[0]?.finish_reason ?? finish;
        }
      }
      const what = `${text} (finish ${finish}) against ${JSON.stringify(schema)}`;
      if (finish === 'stop') {
        ended++;
        expect(ajv.validate(schema, JSON.parse(text)), what).toBe(true);
      } else {
        expect(finish, what).toBe('length');
      }
    }
    console.log(`random JSON schemas: ${ended} of ${trials} replies ended within 160 tokens`);
    // On lavapipe 8 and 7 of the 8 end; a mask that let the model wander would end few.
    expect(ended).toBeGreaterThanOrEqual(6);
  }, 300_000);
});
