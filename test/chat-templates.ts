/**
 * Chat templates for the tool-calling and template-limit tests, and a model file rewritten with one of them. Qwen3's
 * is the real template (from the tokenizer package the tokenizer tests use); the Llama 3.1-style one is written here,
 * in that family's shape: the tools go into the first user message, a call is a JSON reply with its "parameters",
 * and a conversation with tools but no user message is refused.
 */
import type { GgufMetadata } from '../core/gguf-types.ts';
import { parseGguf } from '../runtime/gguf/parse.ts';
import { sourceFromBytes } from '../runtime/gguf/sources.ts';
import { metadataEntriesOf, writeGguf } from '../runtime/gguf/writer.ts';
import { chatTemplateFromMetadata } from '../runtime/tokenizer/chat-template.ts';
import { bpeTokenizerMetadata } from '../tools/fixtures/tokenizer-fixtures.ts';

export function qwen3ChatTemplate(): string {
  return chatTemplateFromMetadata(
    Object.fromEntries(bpeTokenizerMetadata('qwen3').map((e) => [e.key, e.value])) as GgufMetadata,
  );
}

export const LLAMA31_STYLE_TEMPLATE =
  '{{ bos_token }}' +
  "{%- if tools and not (messages | selectattr('role', 'equalto', 'user') | list) %}" +
  "{{ raise_exception('Cannot put tools in the first user message when there is no user message!') }}{%- endif %}" +
  '{%- set ns = namespace(told=false) %}' +
  '{%- for message in messages %}<|start_header_id|>{{ message.role }}<|end_header_id|>\n\n' +
  '{%- if tools and message.role == "user" and not ns.told %}{%- set ns.told = true %}' +
  'Call a function by replying with JSON in the format ' +
  '{"name": function name, "parameters": dictionary of argument name and its value}.\n' +
  '{%- for t in tools %}{{ t | tojson }}\n{%- endfor %}{%- endif %}' +
  '{%- if message.tool_calls %}{%- for call in message.tool_calls %}' +
  '{"name": "{{ call.function.name }}", "parameters": {{ call.function.arguments | tojson }}}' +
  '{%- endfor %}{%- else %}{{ message.content }}{%- endif %}<|eot_id|>{%- endfor %}' +
  '{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}';

/** The GGUF file `bytes` with `template` as its chat template (its tensors as they are). */
export async function withChatTemplate(bytes: Uint8Array, template: string): Promise<Uint8Array<ArrayBuffer>> {
  const file = await parseGguf(sourceFromBytes(bytes));
  const metadata = [
    ...metadataEntriesOf(file, (key) => key !== 'tokenizer.chat_template'),
    { key: 'tokenizer.chat_template', value: template },
  ];
  const tensors = file.tensors.map((t) => ({
    name: t.name,
    shape: t.shape,
    type: t.type,
    data: bytes.subarray(t.offset, t.offset + t.byteLength),
  }));
  return writeGguf({ metadata, tensors, alignment: file.alignment });
}
