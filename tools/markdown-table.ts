/** Markdown tables as Biome formats them (columns padded), so generated docs pass `biome check` as written. */

const cell = (text: string) => text.replace(/\|/g, '\\|');

/** A markdown table with its columns padded as Biome formats them. */
export function markdownTable(header: string[], rows: string[][]): string[] {
  const cells = [header, ...rows].map((r) => r.map(cell));
  const widths = header.map((_, i) => Math.max(3, ...cells.map((r) => [...r[i]].length)));
  const line = (r: string[]) => `| ${r.map((c, i) => c + ' '.repeat(widths[i] - [...c].length)).join(' | ')} |`;
  return [line(cells[0]), `| ${widths.map((w) => '-'.repeat(w)).join(' | ')} |`, ...cells.slice(1).map(line)];
}
