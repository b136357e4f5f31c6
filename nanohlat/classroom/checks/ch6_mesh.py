"""Chapter 6, the mesh: rank <-> (dp, pp, tp) coordinates (6a) and the process groups (6b).

By exhaustive enumeration over LAYOUTS: every rank's coordinates both ways,
and every tp, dp and pp group as the ranks that agree on the other two
coordinates, each listed in increasing order.
"""

from __future__ import annotations

from nanohlat.classroom.checks.grading import case


LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2), (4, 2, 3), (2, 3, 4), (8, 4, 2)]


def check_coords() -> str | None:
    from nanohlat.mesh import coords, rank_of
    for tp, pp, dp in LAYOUTS:
        case(f"tp={tp}, pp={pp}, dp={dp}")
        for rank in range(tp * pp * dp):
            want = ((rank // tp) % dp, rank // (tp * dp), rank % tp)   # tp fastest, then dp, then pp
            got = tuple(coords(rank, tp, pp, dp))
            if got != want:
                return (f"tp={tp}, pp={pp}, dp={dp}: coords({rank}, tp={tp}, pp={pp}, dp={dp}) = {got} (dp, pp, tp), "
                        f"expected {want}")
            back = rank_of(*want, tp, dp)
            if back != rank:
                return (f"tp={tp}, pp={pp}, dp={dp}: rank_of(dp={want[0]}, pp={want[1]}, tp={want[2]}, tp={tp}, "
                        f"dp={dp}) = {back}, expected {rank}")
    return None


def check_groups() -> str | None:
    from nanohlat.mesh import Mesh
    for tp, pp, dp in LAYOUTS:
        world = tp * pp * dp
        coord = {r: ((r // tp) % dp, r // (tp * dp), r % tp) for r in range(world)}
        for kind, axis in (("tp", 2), ("dp", 0), ("pp", 1)):
            case(f"tp={tp}, pp={pp}, dp={dp}, the {kind} groups")
            # oracle: ranks that agree on the other two coordinates, sorted
            want = sorted(sorted(r for r in range(world) if all(coord[r][a] == coord[s][a] for a in range(3) if a != axis))
                          for s in range(world))
            want = [list(g) for g in dict.fromkeys(tuple(g) for g in want)]
            got = Mesh(tp, pp, dp, 0)._all(kind)
            if sorted(sorted(g) for g in got) != want:
                return (f"tp={tp}, pp={pp}, dp={dp}, the {kind} groups: Mesh(tp={tp}, pp={pp}, dp={dp})._all({kind!r}) "
                        f"= {got}, expected the groups {want}")
            if any(g != sorted(g) for g in got):
                return (f"tp={tp}, pp={pp}, dp={dp}, the {kind} groups: Mesh(tp={tp}, pp={pp}, dp={dp})._all({kind!r}): "
                        f"list each group's ranks in increasing order")
    return None
