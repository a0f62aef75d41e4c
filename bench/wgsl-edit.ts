/** `edit` applied to `code`, which it must change: an edit that no longer matches would time the real kernel. */
export function edited(code: string, edit: (code: string) => string, what = 'ablation edit'): string {
  const result = edit(code);
  if (result === code) throw new Error(`${what} did not apply`);
  return result;
}
