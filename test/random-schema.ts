/**
 * A random JSON schema for the structured-output tests: objects (some keys required, no others), arrays, enums,
 * bounded integers, numbers, booleans and bounded strings, nested two levels.
 */
export function randomSchema(random: () => number, depth = 0): Record<string, unknown> {
  const pick = <T>(xs: readonly T[]): T => xs[Math.floor(random() * xs.length)];
  const kind =
    depth >= 2
      ? pick(['string', 'integer', 'number', 'boolean', 'enum'] as const)
      : pick(['object', 'object', 'array', 'integer', 'enum'] as const);
  switch (kind) {
    case 'object': {
      const keys = Array.from(
        { length: 1 + Math.floor(random() * 3) },
        (_, i) => `${pick(['name', 'age', 'tags', 'ok', 'v'])}${i}`,
      );
      const properties = Object.fromEntries(keys.map((k) => [k, randomSchema(random, depth + 1)]));
      return { type: 'object', properties, required: keys.filter(() => random() < 0.7), additionalProperties: false };
    }
    case 'array':
      return { type: 'array', items: randomSchema(random, depth + 1), minItems: 1, maxItems: 3 };
    case 'integer': {
      const minimum = Math.floor(random() * 20) - 10;
      return { type: 'integer', minimum, maximum: minimum + Math.floor(random() * 50) };
    }
    case 'number':
      // No bounds: the grammar engine (xgrammar 0.1.27) bounds integers but not other numbers (a walk spelled 5.8
      // under maximum 5).
      return { type: 'number' };
    case 'boolean':
      return { type: 'boolean' };
    case 'enum':
      return {
        enum: pick([
          ['red', 'green', 'blue'],
          ['yes', 'no'],
          [1, 2, 3],
        ]),
      };
    default:
      return { type: 'string', maxLength: 12 };
  }
}
