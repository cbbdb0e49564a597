//go:build race

package segments

// raceEnabled shrinks the tests whose cost is per input byte: the race
// detector slows byte loops by an order of magnitude.
const raceEnabled = true
