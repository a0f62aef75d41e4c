/**
 * What Copy puts on the clipboard for a reply: its text as the bubble shows it. Markdown drops the blank lines a model
 * often starts with and the whitespace it ends with, so the copy drops them too; the first line's own indentation and
 * everything inside stay as written.
 */
export function copyableText(content: string): string {
  return content.replace(/^(?:[ \t]*\r?\n)+/, '').trimEnd();
}
