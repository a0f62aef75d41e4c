import { describe, expect, it } from 'vitest';
import { InvalidRequestError, UnsupportedModelError } from '../../core/errors.ts';
import type { GgufMetadata } from '../../core/gguf-types.ts';
import { bpeTokenizerMetadata } from '../../tools/fixtures/tokenizer-fixtures.ts';
import {
  type ChatMessage,
  chatTemplateFromMetadata,
  FALLBACK_CHAT_TEMPLATE,
  renderChatTemplate,
} from './chat-template.ts';
import { GgufTokenizer } from './tokenizer.ts';

const conversation: ChatMessage[] = [
  { role: 'system', content: 'You are terse.' },
  { role: 'user', content: 'Hi there' },
  { role: 'assistant', content: 'Hello.' },
  { role: 'user', content: 'What is 2+2?' },
];

function metadataOf(name: 'llama3' | 'qwen3'): GgufMetadata {
  return Object.fromEntries(bpeTokenizerMetadata(name).map((e) => [e.key, e.value]));
}

describe('chat templates', () => {
  it('renders the ChatML fallback for a model without a template', () => {
    const template = chatTemplateFromMetadata({ 'tokenizer.ggml.model': 'llama' });
    expect(template).toBe(FALLBACK_CHAT_TEMPLATE);
    expect(renderChatTemplate(template, { messages: conversation.slice(0, 2) })).toBe(
      '<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n',
    );
    expect(renderChatTemplate(template, { messages: conversation.slice(1, 2), add_generation_prompt: false })).toBe(
      '<|im_start|>user\nHi there<|im_end|>\n',
    );
  });

  it("renders Llama 3's template from the GGUF metadata", () => {
    const meta = metadataOf('llama3');
    const text = renderChatTemplate(chatTemplateFromMetadata(meta), {
      messages: conversation.slice(0, 2),
      bos_token: '<|begin_of_text|>',
    });
    expect(text).toBe(
      '<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>' +
        '<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>' +
        '<|start_header_id|>assistant<|end_header_id|>\n\n',
    );
    // The rendered prompt tokenizes with its markers as single control tokens (BOS comes from the template).
    const tokenizer = GgufTokenizer.fromMetadata(meta);
    const ids = tokenizer.encode(text, { addSpecial: false, parseSpecial: true });
    expect(ids[0]).toBe(tokenizer.bosId);
    expect(ids.filter((id) => id === tokenizer.eotId)).toHaveLength(2);
    expect(tokenizer.decode(ids, { skipSpecial: false })).toBe(text);
  });

  it("renders Qwen 3's template (namespace, reversed loops, generation prompt)", () => {
    const meta = metadataOf('qwen3');
    const text = renderChatTemplate(chatTemplateFromMetadata(meta), { messages: conversation });
    expect(text).toBe(
      '<|im_start|>system\nYou are terse.<|im_end|>\n' +
        '<|im_start|>user\nHi there<|im_end|>\n' +
        '<|im_start|>assistant\nHello.<|im_end|>\n' +
        '<|im_start|>user\nWhat is 2+2?<|im_end|>\n' +
        '<|im_start|>assistant\n',
    );
    const tokenizer = GgufTokenizer.fromMetadata(meta);
    const imEnd = tokenizer.encode('<|im_end|>', { addSpecial: false, parseSpecial: true });
    expect(imEnd).toHaveLength(1);
    expect(tokenizer.isEndOfGeneration(imEnd[0])).toBe(true);
  });

  it('gives templates no way to reach JavaScript objects', () => {
    const probes = [
      "{{ ''.constructor }}",
      '{{ messages.__proto__ }}',
      '{{ messages.constructor }}',
      "{{ messages[0]['__proto__'] }}",
      '{{ messages[0].content.__proto__ }}',
      '{{ globalThis }}{{ process }}{{ window }}{{ require }}',
      '{% set x = messages.__proto__ %}{{ x }}',
      '{{ (1).constructor }}{{ [].constructor }}',
    ];
    for (const probe of probes) {
      expect(renderChatTemplate(probe, { messages: conversation }), probe).toBe('');
    }
    // Calling through a prototype chain fails inside the interpreter instead of running code.
    expect(() =>
      renderChatTemplate("{{ ''.constructor.constructor('return process')() }}", { messages: conversation }),
    ).toThrow(InvalidRequestError);
    expect(({} as Record<string, unknown>).polluted).toBeUndefined();
  });

  it('reports a template that rejects the conversation, and one that does not parse', () => {
    const strict =
      "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}";
    expect(() => renderChatTemplate(strict, { messages: conversation })).toThrow(InvalidRequestError);
    expect(() => renderChatTemplate(strict, { messages: conversation })).toThrow(/must start with user/);
    expect(() => renderChatTemplate('{% for %}', { messages: conversation })).toThrow(UnsupportedModelError);
  });
});
